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


def choose_backend(requested: str, model, *, use_vllm: bool, use_continuous_batching: bool) -> tuple[str, str]:
    """(backend, reason) for this trainer. An explicit "engine" on an unsupported model is an error."""
    if requested == "vllm" or use_vllm:
        return "vllm", "vLLM requested"
    if requested == "transformers" or use_continuous_batching:
        return "transformers", "transformers requested"
    from slimrl.rollout.engine import supports

    supported, why = supports(model)
    if requested == "engine":
        if not supported:
            raise ValueError(f"generation_backend='engine' cannot run this model: {why}. Use 'transformers'.")
        return "engine", "engine requested"
    if not torch.cuda.is_available():
        return "transformers", "no CUDA device: the engine's captured decode step needs one"
    if not supported:
        return "transformers", why
    return "engine", "CUDA and a supported architecture"


def engine_sampling_params(trainer):
    """The engine's SamplingParams from TRL's generation settings, with `generation_kwargs` as overrides."""
    from slimrl.rollout.sampling import SamplingParams

    args = trainer.args
    settings = dict(
        temperature=trainer.temperature,
        top_p=args.top_p,
        top_k=args.top_k or 0,
        min_p=args.min_p or 0.0,
        repetition_penalty=args.repetition_penalty,
        stop_token_ids=list(trainer.eos_token_ids),
    )
    extra = dict(args.generation_kwargs or {})
    unknown = sorted(set(extra) - set(_ENGINE_SAMPLING_KEYS))
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown} are not supported by slimrl's rollout engine (it understands "
            f"{', '.join(_ENGINE_SAMPLING_KEYS)}); remove them or set generation_backend='transformers'."
        )
    settings.update(extra)
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
