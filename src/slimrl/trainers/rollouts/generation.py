"""Which backend generates a GRPO rollout, and the engine path of `_generate_single_turn`.

Backends: "engine" (slimrl's rollout engine, decoding with the training weights in place), "transformers" (TRL's
default `generate` path, or its continuous batching when `use_transformers_continuous_batching`), "vllm" (TRL's own
vLLM integration), and "auto": the engine on CUDA when the model is supported, else TRL's path. A model loaded with
FastLanguageModel.from_pretrained(fast_inference=True) turns "auto" into a demand for the engine (on the CPU too, where
it runs its eager path); a config that names another backend still wins, with a warning.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "engine", "transformers", "vllm")

# TRL's generation_kwargs (vLLM SamplingParams-style) that the engine understands; others are refused by name.
_ENGINE_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop", "stop_token_ids",
                         "seed", "max_tokens")  # fmt: skip
# The engine's memory budget for a model not loaded by FastLanguageModel (which records its own, default 0.5): the
# whole GPU, so a wave is never planned past the device's memory.
WHOLE_GPU = 1.0


def fast_inference_of(model) -> bool:
    """Whether `model` (peft-wrapped or not; a model id string is not) was loaded with fast_inference=True."""
    return bool(getattr(getattr(model, "slimrl_options", None), "fast_inference", False))


def engine_memory_utilization(model) -> float:
    """The fraction of the GPU the engine's waves may fill (RolloutEngine's gpu_memory_utilization): the model's
    FastLanguageModel.from_pretrained value (default 0.5), with fast_inference or without; WHOLE_GPU otherwise."""
    value = getattr(getattr(model, "slimrl_options", None), "gpu_memory_utilization", None)
    return WHOLE_GPU if value is None else float(value)


def local_engine(model, tokenizer, deterministic: bool):
    """An in-process RolloutEngine over `model`'s live weights, sized as from_pretrained recorded: its max_seq_length
    (None: the model's context) and its gpu_memory_utilization for the waves and KV cache, fast_inference or not."""
    from slimrl.rollout.engine import RolloutEngine

    # cap_completions=False: a prompt that would leave its completion short of max_completion_length is an error
    # naming it, not a silently shorter completion (choose_backend checked the lengths the config gives)
    return RolloutEngine(model, max_seq_len=engine_max_seq_length(model),
                         gpu_memory_utilization=engine_memory_utilization(model), tokenizer=tokenizer,
                         cap_completions=False, deterministic=deterministic)  # fmt: skip


def engine_max_seq_length(model) -> int | None:
    """The cache length the trainers' engine gets: FastLanguageModel.from_pretrained's max_seq_length (None: the
    model's context, `RolloutEngine`'s default)."""
    return getattr(getattr(model, "slimrl_options", None), "max_seq_length", None)


def engine_refusal(demanded_by: str, why: str) -> ValueError:
    """The error for an engine that was asked for (by the config or by fast_inference) and cannot serve the run."""
    if demanded_by == "fast_inference":
        return ValueError(
            f"fast_inference=True asks for slimrl's rollout engine, which cannot serve this run: {why}. Load the model "
            "with fast_inference=False (rollouts then use TRL's transformers path), or set "
            "generation_backend='transformers' in the config."
        )
    return ValueError(f"generation_backend='engine' cannot serve this run: {why}. Use 'transformers'.")


def choose_backend(
    requested: str,
    model,
    *,
    use_vllm: bool,
    use_continuous_batching: bool,
    generation_kwargs: dict | None = None,
    fast_inference: bool = False,
    max_prompt_length: int | None = None,
    max_completion_length: int | None = None,
) -> tuple[str, str]:
    """(backend, reason) for this trainer. The engine asked for explicitly ("engine") or by fast_inference=True under
    "auto" is an error when it cannot serve the settings (`engine_refusal`); a config naming another backend
    (generation_backend, use_vllm, use_transformers_continuous_batching) wins over fast_inference, with a warning.
    What the engine will be asked is checked here, before training (`supports`): the architecture, its sliding
    windows, and the longest prompt (when the config bounds it) plus max_completion_length against the cache the
    engine will allocate (`engine_max_seq_length`); under "auto" a refusal falls back to TRL's path with the reason."""
    if requested not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {BACKENDS}, got {requested!r}.")
    named, setting = _named_backend(requested, use_vllm, use_continuous_batching)
    if named is not None:
        if fast_inference:
            logger.warning("slimrl: %s in the config overrides the model's fast_inference=True: rollouts use TRL's %s "
                           "path, not slimrl's engine.", setting, named)  # fmt: skip
        return named, f"{setting} requested"
    from slimrl.rollout.engine import supports

    supported, why = supports(model, max_prompt_length=max_prompt_length, max_completion_length=max_completion_length,
                              max_seq_len=engine_max_seq_length(model))  # fmt: skip
    unknown = sorted(set(generation_kwargs or {}) - set(_ENGINE_SAMPLING_KEYS))
    if supported and unknown:
        supported, why = False, f"generation_kwargs {unknown} are transformers-only"
    if requested == "engine" or fast_inference:
        demanded_by = "generation_backend" if requested == "engine" else "fast_inference"
        if not supported:
            raise engine_refusal(demanded_by, why)
        if not torch.cuda.is_available():
            return "engine", f"{demanded_by} asks for the engine; no CUDA device, so its eager path runs"
        return "engine", f"{demanded_by} asks for the engine"
    if not supported:  # named first: on the CPU too, the log says what the engine could not serve
        return "transformers", why
    if not torch.cuda.is_available():
        return "transformers", "no CUDA device: the engine's captured decode step needs one"
    return "engine", "CUDA and a supported architecture"


def _named_backend(requested: str, use_vllm: bool, use_continuous_batching: bool) -> tuple[str | None, str]:
    """(TRL backend, the setting that names it) when the config names one of TRL's paths, else (None, "")."""
    if requested == "vllm":
        return "vllm", "generation_backend='vllm'"
    if use_vllm:
        return "vllm", "use_vllm=True"
    if requested == "transformers":
        return "transformers", "generation_backend='transformers'"
    if use_continuous_batching:
        return "transformers", "use_transformers_continuous_batching=True"
    return None, ""


def engine_sampling_params(trainer, device: torch.device):
    """The engine's SamplingParams from TRL's generation settings, with `generation_kwargs` as overrides. Off CUDA
    the engine draws as transformers' generate does (`sampler="multinomial"`), so a seed gives TRL's completions."""
    from slimrl.rollout.sampling import SamplingParams

    args = trainer.args
    settings = dict(
        sampler="race" if device.type == "cuda" else "multinomial",
        temperature=trainer.temperature,
        top_p=args.top_p,
        top_k=args.top_k or 0,
        min_p=args.min_p or 0.0,
        repetition_penalty=args.repetition_penalty,
        stop_token_ids=list(trainer.eos_token_ids),
    )
    settings.update(args.generation_kwargs or {})  # vLLM SamplingParams-style overrides (choose_backend vetted them)
    return SamplingParams(**settings)


@contextlib.contextmanager
def inference_mode(model):
    """Eval mode (no dropout, LoRA dropout included) for the rollout; the previous mode comes back afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
