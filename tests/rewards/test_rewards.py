"""Reward functions: TRL's signature, plain and conversational completions, never raising on odd text."""

import pytest

from slimrl.rewards import completion_text, exact_answer_reward, extract_answer, format_reward, length_penalty


def as_message(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "text,expected",
    [("16", "16"), ("7 + 9 = 16.", "16"), ("Answer: 16", "16"), ("Answer: 15, no wait 16", "15"),
     ("Answer: 16.0", "16"), ("-3", "-3"), ("no number here", None), ("", None)],
)  # fmt: skip
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_exact_answer_reward_on_plain_and_conversational_completions():
    completions = ["16", as_message("7 + 9 = 16"), "17", as_message("")]
    assert exact_answer_reward(completions, answer=["16", "16", "16", "16"]) == [1.0, 1.0, 0.0, 0.0]


def test_exact_answer_reward_needs_one_answer_per_completion():
    with pytest.raises(ValueError):
        exact_answer_reward(["16", "3"], answer=["16"])


def test_format_reward_grades_bare_short_and_rambling_answers():
    completions = ["16", "Answer: 16", "7 + 9 = 16.", "The answer to this question is 16.", "sixteen", "16\n17"]
    assert format_reward(completions) == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0]


def test_rewards_never_raise_on_odd_completions():
    odd = [None, 3, [], [{"role": "assistant"}], "\x00\x01", "9" * 500]
    assert len(format_reward(odd)) == len(odd)
    assert len(exact_answer_reward(odd, answer=["1"] * len(odd))) == len(odd)
    assert completion_text(None) == "" and completion_text([{"role": "assistant"}]) == ""


def test_length_penalty():
    reward = length_penalty(10, weight=2.0)
    assert reward(["a" * 5, "a" * 10, "a" * 15]) == [0.0, 0.0, -1.0]
    assert reward.__name__ == "length_penalty_10"
    with pytest.raises(ValueError):
        length_penalty(0)
