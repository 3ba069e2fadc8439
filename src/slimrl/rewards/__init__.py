"""Reusable reward functions with TRL's signature: `f(completions, **dataset_columns) -> list[float]`."""

from slimrl.rewards.answers import (
    completion_text,
    exact_answer_reward,
    extract_answer,
    format_reward,
    is_bare_answer,
    last_integer,
)
from slimrl.rewards.length import length_penalty

__all__ = [
    "completion_text",
    "exact_answer_reward",
    "extract_answer",
    "format_reward",
    "is_bare_answer",
    "last_integer",
    "length_penalty",
]
