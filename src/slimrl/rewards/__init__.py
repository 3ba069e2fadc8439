"""Reusable reward functions with TRL's signature: `f(completions, **dataset_columns) -> list[float]`."""

from slimrl.rewards.answers import (
    completion_text,
    exact_answer_reward,
    extract_answer,
    format_reward,
    is_in_format,
    normalise_number,
)
from slimrl.rewards.length import length_penalty

__all__ = [
    "completion_text",
    "exact_answer_reward",
    "extract_answer",
    "format_reward",
    "is_in_format",
    "length_penalty",
    "normalise_number",
]
