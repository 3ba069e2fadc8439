"""Reward functions: TRL's signature, plain and conversational completions, never raising on odd text."""

import pytest

from slimrl.rewards import (
    completion_text,
    exact_answer_reward,
    extract_answer,
    format_reward,
    is_in_format,
    length_penalty,
    normalise_number,
)


def as_message(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "text,expected",
    [("16", "16"), ("7 + 9 = 16.", "16"), ("Answer: 16", "16"), ("Answer: 15, no wait 16", "15"),
     ("answer:16.0", "16"), ("-3", "-3"), ("5-3=2", "2"), ("It is 1,250.", "1250"), ("0.50", "0.5"),
     ("no number here", None), ("", None)],
)  # fmt: skip
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "number,expected",
    [("16", "16"), ("007", "7"), ("-0", "0"), ("-0.0", "0"), ("2.500", "2.5"), ("1,000", "1000"), (" 4 ", "4"),
     ("abc", "abc"), ("9" * 5000, "9" * 5000)],
)  # fmt: skip
def test_normalise_number_gives_one_spelling_per_value(number, expected):
    assert normalise_number(number) == expected


def test_exact_answer_reward_on_plain_and_conversational_completions():
    completions = ["16", as_message("7 + 9 = 16"), "17", as_message(""), "Answer: 16.0"]
    assert exact_answer_reward(completions, answer=["16", "16", "16", "16", 16]) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_exact_answer_reward_needs_one_answer_per_completion():
    with pytest.raises(ValueError):
        exact_answer_reward(["16", "3"], answer=["16"])


@pytest.mark.parametrize(
    "text,in_format",
    [("16", True), ("16.", True), ("Answer: 16", True), ("7 + 9 = 16", True), ("  7 + 9 = 16.  ", True),
     ("The sum of 7 and 9 is 16.", True), ("16 is the answer", False), ("sixteen", False), ("16\n17", False),
     ("7 + 9 = 16\n.", False), ("To solve this we add the two numbers, 7 and 9, which gives 16", False), ("", False)],
)  # fmt: skip
def test_format_is_one_short_line_ending_with_a_number(text, in_format):
    assert is_in_format(text) is in_format
    assert format_reward([text, as_message(text)]) == [float(in_format)] * 2


def test_rewards_never_raise_on_odd_completions():
    odd = [None, 3, [], [{"role": "assistant"}], [{"content": None}], "\x00\x01", "9" * 5000, "1." * 3000, "-" * 99]
    assert format_reward(odd) == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert exact_answer_reward(odd, answer=["3"] * len(odd)) == [0.0, 1.0] + [0.0] * 7
    assert length_penalty(4)(odd)[1] == 0.0
    assert extract_answer(None) is None and completion_text(None) == "" and completion_text([{"role": "x"}]) == ""
    assert completion_text([{"content": None}]) == "" and completion_text([{"content": [{"text": None}, 5]}]) == ""


def test_completion_text_reads_typed_content_parts():
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "7 + 9"}, {"type": "text", "text": " = 16"}]}]
    assert completion_text(parts) == "7 + 9 = 16" and exact_answer_reward([parts], answer=["16"]) == [1.0]


def test_length_penalty_charges_only_the_excess_over_the_target():
    reward = length_penalty(10, weight=2.0)
    assert reward(["a" * 5, "a" * 10, as_message("a" * 15)]) == [0.0, 0.0, -1.0]
    assert reward.__name__ == "length_penalty_10"
    with pytest.raises(ValueError, match="target_chars must be positive"):
        length_penalty(0)
