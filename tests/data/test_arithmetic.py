"""The built-in arithmetic dataset: reproducible, exact, disjoint splits, conversational prompts."""

import pytest

from slimrl.data import DIFFICULTIES, INSTRUCTION, arithmetic_dataset, arithmetic_rows, split_size


def expression_of(row):
    return row["question"].removeprefix("What is ").removesuffix("?")


def test_same_seed_same_problems_and_different_seed_different_problems():
    assert arithmetic_rows(20, seed=3) == arithmetic_rows(20, seed=3)
    assert arithmetic_rows(20, seed=3) != arithmetic_rows(20, seed=4)
    assert len({r["question"] for r in arithmetic_rows(100, seed=3)}) == 100  # distinct within a draw


@pytest.mark.parametrize("difficulty", list(DIFFICULTIES))
def test_answers_are_exact_non_negative_and_within_the_difficulty(difficulty):
    for row in arithmetic_rows(25, seed=1, difficulty=difficulty):
        a, op, b = expression_of(row).split()
        assert op in "+-" and 1 <= int(a) <= DIFFICULTIES[difficulty] and 1 <= int(b) <= DIFFICULTIES[difficulty]
        assert str(int(a) + int(b) if op == "+" else int(a) - int(b)) == row["answer"]
        assert int(row["answer"]) >= 0


def test_train_and_eval_splits_never_share_a_problem_whatever_the_seeds():
    train = {r["question"] for seed in (0, 1) for r in arithmetic_rows(150, seed=seed, split="train")}
    held_out = {r["question"] for seed in (0, 2) for r in arithmetic_rows(60, seed=seed, split="eval")}
    assert len(held_out) > 60 and not train & held_out


def test_a_split_can_be_drawn_whole():
    size = split_size("easy", "eval")
    assert len({r["question"] for r in arithmetic_rows(size, difficulty="easy", split="eval")}) == size


def test_dataset_has_conversational_prompts_and_string_answers():
    dataset = arithmetic_dataset(4, seed=0)
    assert dataset.column_names == ["prompt", "answer"] and len(dataset) == 4
    prompt = dataset[0]["prompt"]
    assert [m["role"] for m in prompt] == ["user"] and prompt[0]["content"].endswith(INSTRUCTION)
    assert isinstance(dataset[0]["answer"], str)
    with_system = arithmetic_dataset(2, system_prompt="Be brief.", instruction="")
    assert with_system[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert with_system[0]["prompt"][1]["content"].endswith("?")


def test_with_a_tokenizer_the_prompt_is_the_rendered_chat_template(tokenizer):
    dataset = arithmetic_dataset(3, seed=5, tokenizer=tokenizer, system_prompt="Be brief.")
    messages = arithmetic_dataset(3, seed=5, system_prompt="Be brief.")[0]["prompt"]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert dataset[0]["prompt"] == expected and expected.endswith("<|im_start|>assistant\n")


def test_bad_arguments_are_errors_that_say_what_to_change(tokenizer):
    with pytest.raises(ValueError, match="fewer problems"):
        arithmetic_rows(split_size("easy", "train") + 1, difficulty="easy")
    with pytest.raises(ValueError, match="split must be"):
        arithmetic_rows(2, split="test")
    with pytest.raises(ValueError, match="difficulty must be one of easy, medium, hard"):
        arithmetic_rows(2, difficulty="extreme")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        arithmetic_dataset(2, tokenizer=tokenizer)
