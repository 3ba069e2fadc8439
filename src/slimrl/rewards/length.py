"""A length-shaping reward."""

from __future__ import annotations

from collections.abc import Callable

from slimrl.rewards.answers import completion_text


def length_penalty(target_chars: int, weight: float = 1.0) -> Callable[..., list[float]]:
    """A reward of -weight * (excess / target) for completions longer than `target_chars` characters, 0 otherwise."""
    if target_chars <= 0:
        raise ValueError(f"target_chars must be positive, got {target_chars}")

    def length_penalty_reward(completions, **kwargs) -> list[float]:
        return [-weight * max(0, len(completion_text(c)) - target_chars) / target_chars for c in completions]

    length_penalty_reward.__name__ = f"length_penalty_{target_chars}"
    return length_penalty_reward
