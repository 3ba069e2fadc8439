"""Which backend generates a GRPO rollout, and the engine path of `_generate_single_turn`.

Backends: "engine" (slimrl's rollout engine, decoding with the training weights in place), "transformers" (TRL's
default `generate` path, or its continuous batching when `use_transformers_continuous_batching`), "vllm" (TRL's own
vLLM integration), and "auto": the engine on CUDA when the model is supported, else TRL's path.
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


def choose_backend(
    requested: str, model, *, use_vllm: bool, use_continuous_batching: bool, generation_kwargs: dict | None = None
) -> tuple[str, str]:
    """(backend, reason) for this trainer. An explicit "engine" that cannot serve the settings is an error."""
    if requested not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {BACKENDS}, got {requested!r}.")
    if requested == "vllm" or use_vllm:
        return "vllm", "vLLM requested"
    if requested == "transformers" or use_continuous_batching:
        return "transformers", "transformers requested"
    from slimrl.rollout.engine import supports

    supported, why = supports(model)
    unknown = sorted(set(generation_kwargs or {}) - set(_ENGINE_SAMPLING_KEYS))
    if supported and unknown:
        supported, why = False, f"generation_kwargs {unknown} are transformers-only"
    if requested == "engine":
        if not supported:
            raise ValueError(f"generation_backend='engine' cannot serve this run: {why}. Use 'transformers'.")
        return "engine", "engine requested"
    if not torch.cuda.is_available():
        return "transformers", "no CUDA device: the engine's captured decode step needs one"
    if not supported:
        return "transformers", why
    return "engine", "CUDA and a supported architecture"


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
