"""The built-in arithmetic dataset: reproducible, exact, disjoint splits, conversational prompts."""

import pytest

from slimrl.data import arithmetic_dataset, arithmetic_rows


def test_same_seed_same_problems_and_different_seed_different_problems():
    assert arithmetic_rows(20, seed=3) == arithmetic_rows(20, seed=3)
    assert arithmetic_rows(20, seed=3) != arithmetic_rows(20, seed=4)


def test_answers_are_exact():
    for row in arithmetic_rows(100, seed=1):
        expression = row["question"].removeprefix("What is ").removesuffix("?")
        assert str(eval(expression)) == row["answer"]  # noqa: S307 (our own generated arithmetic)
        assert int(row["answer"]) >= 0


def test_train_and_eval_splits_never_share_a_problem():
    train = {r["question"] for r in arithmetic_rows(150, seed=0, split="train")}
    held_out = {r["question"] for r in arithmetic_rows(60, seed=0, split="eval")}
    assert len(train) == 150 and len(held_out) == 60 and not train & held_out


def test_dataset_has_conversational_prompts_and_answers():
    dataset = arithmetic_dataset(4, seed=0)
    assert dataset.column_names == ["prompt", "answer"]
    prompt = dataset[0]["prompt"]
    assert prompt[-1]["role"] == "user" and "Answer with just the number." in prompt[-1]["content"]
    with_system = arithmetic_dataset(2, system_prompt="Be brief.")
    assert with_system[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_too_many_problems_or_unknown_split_is_an_error():
    with pytest.raises(ValueError, match="too many"):
        arithmetic_rows(10_000, max_operand=5)
    with pytest.raises(ValueError, match="split must be"):
        arithmetic_rows(2, split="test")
