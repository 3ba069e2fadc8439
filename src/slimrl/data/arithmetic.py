"""A built-in arithmetic dataset: generated problems with exact answers, as chat prompts. Seeded and reproducible."""

from __future__ import annotations

import random

INSTRUCTION = "Answer with just the number."
OPERATIONS = ("+", "-")


def make_problem(rng: random.Random, max_operand: int) -> tuple[str, int]:
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    op = rng.choice(OPERATIONS)
    if op == "-" and b > a:
        a, b = b, a  # keep results non-negative: small models handle them more reliably
    return f"{a} {op} {b}", a + b if op == "+" else a - b


def arithmetic_rows(n: int, seed: int = 0, max_operand: int = 20, split: str = "train") -> list[dict]:
    """`n` distinct problems of one split. Train and eval draw from disjoint halves of the problem space (split by
    a hash of the expression), so no eval problem is ever trained on."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    capacity = max_operand * max_operand * len(OPERATIONS) // 2
    if n > capacity // 2:
        raise ValueError(f"n={n} problems is too many for max_operand={max_operand}; raise max_operand.")
    rng = random.Random(f"{seed}-{split}")
    rows, seen = [], set()
    while len(rows) < n:
        expression, result = make_problem(rng, max_operand)
        if expression in seen or _split_of(expression) != split:
            continue
        seen.add(expression)
        rows.append({"question": f"What is {expression}?", "answer": str(result)})
    return rows


def _split_of(expression: str) -> str:
    # a stable hash (Python's hash() is salted per process)
    return "eval" if sum(ord(ch) * (i + 1) for i, ch in enumerate(expression)) % 4 == 0 else "train"


def arithmetic_dataset(
    n: int,
    seed: int = 0,
    max_operand: int = 20,
    split: str = "train",
    instruction: str = INSTRUCTION,
    system_prompt=None,
):
    """A `datasets.Dataset` with a conversational `prompt` column and an `answer` column (the integer, as text).

    The prompt is the user's question and the requested format; the model's chat template adds its own default
    system prompt unless `system_prompt` is given."""
    from datasets import Dataset

    rows = arithmetic_rows(n, seed=seed, max_operand=max_operand, split=split)
    return Dataset.from_list(
        [
            {
                "prompt": ([{"role": "system", "content": system_prompt}] if system_prompt else [])
                + [{"role": "user", "content": f"{row['question']} {instruction}"}],
                "answer": row["answer"],
            }
            for row in rows
        ]
    )
