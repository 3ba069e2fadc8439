"""Rewards for problems with one exact numeric answer.

The final answer of a completion is the number after its last 'Answer:' when it has one, else its last number.
"""

from __future__ import annotations

import re

ANSWER_PATTERN = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
BARE_ANSWER_PATTERN = re.compile(r"^\s*(?:Answer:\s*)?-?\d+(?:\.\d+)?\s*\.?\s*$", re.IGNORECASE)
INTEGER_PATTERN = re.compile(r"-?\d+")
NUMBER_PATTERN = re.compile(r"-?\d+(?:\.\d+)?")
SHORT_ANSWER_CHARS = 24


def completion_text(completion) -> str:
    """The text of a completion: a string, or the content of the last message of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return "" if completion is None else str(completion)


def extract_answer(text: str) -> str | None:
    """The final answer, normalised ('7.0' -> '7'): the number after the last 'Answer:', else the last number."""
    matches = ANSWER_PATTERN.findall(text) or NUMBER_PATTERN.findall(text)
    return _normalise(matches[-1]) if matches else None


def last_integer(text: str) -> str | None:
    """The last integer anywhere in the text (a lenient reading of an unformatted answer)."""
    matches = INTEGER_PATTERN.findall(text)
    return matches[-1] if matches else None


def _normalise(number: str) -> str:
    value = float(number)
    return str(int(value)) if value.is_integer() else str(value)


def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the dataset's `answer` column, else 0.0."""
    return [
        1.0 if extract_answer(completion_text(c)) == _normalise(str(a)) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for a bare answer ('16', '16.', 'Answer: 16'), 0.5 for one short line holding a number
    ('7 + 9 = 16.'), else 0.0."""
    rewards = []
    for completion in completions:
        text = completion_text(completion).strip()
        if BARE_ANSWER_PATTERN.match(text):
            rewards.append(1.0)
        elif "\n" not in text and len(text) <= SHORT_ANSWER_CHARS and NUMBER_PATTERN.search(text):
            rewards.append(0.5)
        else:
            rewards.append(0.0)
    return rewards


def is_bare_answer(text: str) -> bool:
    return bool(BARE_ANSWER_PATTERN.match(text.strip()))
