"""Rewards for problems with one exact numeric answer.

The final answer of a completion is the number after its last 'Answer:' when it has one, else its last number. The
requested format is one short line that ends with the answer ('7 + 9 = 16', '16', 'Answer: 16.').
"""

from __future__ import annotations

import re

# a number: optional sign, digits (thousands may be grouped with commas), optional decimals
NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
ANSWER_PATTERN = re.compile(rf"Answer:\s*({NUMBER})", re.IGNORECASE)
NUMBER_PATTERN = re.compile(NUMBER)
ONE_LINE_ENDING_IN_NUMBER = re.compile(rf"[^\n]*?(?<![\d.]){NUMBER} *\.?")
# longer than this is no longer a short line ('12 + 19 = 31' is 12 characters, a sentence around it some 40)
MAX_FORMAT_CHARS = 48


def completion_text(completion) -> str:
    """The text of a completion: a string, or the content of the last message of a conversational completion (its
    text parts joined, when the content is a list of typed parts)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, list):
            return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
        return "" if content is None else str(content)
    return "" if completion is None else str(completion)


def extract_answer(text: str) -> str | None:
    """The final answer, normalised ('16.0' -> '16', '1,000' -> '1000'): the number after the last 'Answer:', else
    the last number; None when there is no number."""
    if not isinstance(text, str):
        return None
    matches = ANSWER_PATTERN.findall(text) or NUMBER_PATTERN.findall(text)
    return normalise_number(matches[-1]) if matches else None


def normalise_number(number: str) -> str:
    """One spelling per value, by string rules alone (int() refuses numbers of thousands of digits): no grouping
    commas, no leading zeros, no trailing decimal zeros, no minus on zero. Text that is not a number comes back
    stripped."""
    text = str(number).strip().replace(",", "")
    if not NUMBER_PATTERN.fullmatch(text):
        return text
    sign = "-" if text.startswith("-") else ""
    whole, _, fraction = text.lstrip("-").partition(".")
    whole, fraction = whole.lstrip("0") or "0", fraction.rstrip("0")
    value = f"{whole}.{fraction}" if fraction else whole
    return "0" if value == "0" else sign + value


def is_in_format(text: str) -> bool:
    """Whether a reply is one short line that ends with a number (a trailing full stop allowed)."""
    text = text.strip() if isinstance(text, str) else ""
    return len(text) <= MAX_FORMAT_CHARS and ONE_LINE_ENDING_IN_NUMBER.fullmatch(text) is not None


def exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the dataset's `answer` column, else 0.0."""
    return [
        1.0 if extract_answer(completion_text(c)) == normalise_number(a) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for one short line that ends with a number ('7 + 9 = 16', '16.', 'Answer: 16'), else 0.0."""
    return [1.0 if is_in_format(completion_text(c)) else 0.0 for c in completions]
