"""The lengths a run will ask of the engine, against the cache it allocates: `supports()` refuses, before training,
a prompt + completion that would otherwise fail (or be cut) at rollout time."""

from __future__ import annotations

from torch import nn


def engine_max_seq_len(model: nn.Module, max_seq_len: int | None) -> int:
    """The longest prompt + completion the engine's cache holds: max_seq_len, else the model's context."""
    return int(max_seq_len or getattr(getattr(model, "config", None), "max_position_embeddings", None) or 4096)


def length_problem(model: nn.Module, max_prompt_length: int | None, max_completion_length: int | None,
                   max_seq_len: int | None) -> str | None:  # fmt: skip
    """Why a prompt of max_prompt_length tokens (at least one) and a completion of max_completion_length do not fit
    the engine's cache (`engine_max_seq_len`), with the fix; None when they fit or neither is given."""
    if max_prompt_length is None and max_completion_length is None:
        return None
    limit = engine_max_seq_len(model, max_seq_len)
    fix = "raise max_seq_length (FastLanguageModel.from_pretrained's; RolloutEngine's max_seq_len)"
    if max_completion_length is None:
        if max_prompt_length >= limit:
            return (f"prompts of up to {max_prompt_length} tokens leave no room for a completion in the engine's "
                    f"max_seq_len={limit}; shorten the prompts or {fix}")  # fmt: skip
        return None
    prompt = max(1, max_prompt_length or 1)
    if prompt + max_completion_length > limit:
        what = f"prompts of up to {prompt} tokens" if max_prompt_length else "a prompt of even one token"
        return (f"{what} plus max_completion_length={max_completion_length} pass the engine's max_seq_len={limit} "
                f"(its KV cache); lower max_completion_length{' or the prompt length' if max_prompt_length else ''}, "
                f"or {fix}")  # fmt: skip
    return None
