"""A built-in arithmetic dataset: generated problems with exact answers, as chat prompts. Seeded and reproducible."""

from __future__ import annotations

import random

# SmolLM2-135M-Instruct ignores requests for a bare number or 'Answer: N' (it never samples them, so GRPO has nothing
# to reinforce) but already writes '7 + 9 = 16' about half the time: a format it can learn within a few steps.
INSTRUCTION = "Reply in one line that ends with the result."
OPERATIONS = ("+", "-")
# difficulty -> largest operand; "medium" leaves a 135M instruct model about 40% right before training
DIFFICULTIES = {"easy": 9, "medium": 20, "hard": 99}
SPLITS = ("train", "eval")


def max_operand_for(difficulty: str) -> int:
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}, got {difficulty!r}")
    return DIFFICULTIES[difficulty]


def all_problems(difficulty: str = "medium") -> list[tuple[str, int]]:
    """Every distinct problem of a difficulty as (expression, result), in a fixed order. Subtractions keep the larger
    operand first: small models handle non-negative results more reliably."""
    largest = max_operand_for(difficulty)
    operands = range(1, largest + 1)
    additions = [(f"{a} + {b}", a + b) for a in operands for b in operands]
    subtractions = [(f"{a} - {b}", a - b) for a in operands for b in operands if a >= b]
    return additions + subtractions


def split_size(difficulty: str = "medium", split: str = "train") -> int:
    """How many distinct problems one split of a difficulty holds."""
    return sum(split_of(expression) == split for expression, _ in all_problems(difficulty))


def arithmetic_rows(n: int, seed: int = 0, difficulty: str = "medium", split: str = "train") -> list[dict]:
    """`n` distinct problems of one split, as {"question", "answer"} rows, drawn at random with `seed`. Train and eval
    come from disjoint parts of the problem space (chosen by a hash of the expression), so no eval problem is ever
    trained on."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    pool = [problem for problem in all_problems(difficulty) if split_of(problem[0]) == split]
    if n > len(pool):
        raise ValueError(f"n={n} is more than the {len(pool)} problems of the {difficulty!r} {split} split; use a "
                         f"harder difficulty or fewer problems.")  # fmt: skip
    chosen = random.Random(f"{seed}-{split}").sample(pool, n)
    return [{"question": f"What is {expression}?", "answer": str(result)} for expression, result in chosen]


def split_of(expression: str) -> str:
    """The split an expression belongs to: a quarter of the problems are held out. A stable hash, because Python's
    hash() of a string changes from process to process."""
    return "eval" if sum(ord(ch) * (i + 1) for i, ch in enumerate(expression)) % 4 == 0 else "train"


def arithmetic_dataset(
    n: int,
    seed: int = 0,
    difficulty: str = "medium",
    split: str = "train",
    tokenizer=None,
    system_prompt: str | None = None,
    instruction: str = INSTRUCTION,
):
    """A `datasets.Dataset` of `n` problems with a `prompt` column and an `answer` column (the integer, as text).

    The prompt is a conversation (TRL applies the model's chat template to it): a system message when
    `system_prompt` is given (otherwise the template adds its own default, if it has one) and the user's question
    with `instruction`. Given a `tokenizer`, the prompt is instead the text its chat template renders, ending where
    the assistant's reply starts. `difficulty` is "easy" (operands up to 9), "medium" (up to 20) or "hard" (up to 99).
    """
    from datasets import Dataset

    if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template; pass tokenizer=None to keep conversational prompts.")
    prompts, answers = [], []
    for row in arithmetic_rows(n, seed=seed, difficulty=difficulty, split=split):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": f"{row['question']} {instruction}".strip()})
        if tokenizer is not None:
            messages = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(messages)
        answers.append(row["answer"])
    return Dataset.from_dict({"prompt": prompts, "answer": answers})
