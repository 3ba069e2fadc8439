"""Dataset checks shared across trainer families: every online trainer (GRPO, RLOO, online DPO, PPO) checks at
construction that each dataset is one split with a 'prompt' column (TRL itself accepts such a dataset and fails at
train() with a bare KeyError: 'prompt'); the offline trainers (SFT, reward) report the rows TRL's preparation left
out."""

from __future__ import annotations

import warnings

from datasets import Dataset

from slimrl.trainers.common.preference_inputs import dataset_columns

# columns that often hold the prompts under another name, for the rename the error suggests
PROMPT_LIKE = ("question", "query", "problem", "instruction", "input", "text", "messages", "conversations")


def check_prompt_datasets(train_dataset, eval_dataset, trainer: str, prompt_optional: bool = False) -> None:
    """`check_prompt_column` on the train dataset and on the eval dataset (each of them, when a dict of named eval
    datasets is given, as the Trainer evaluates a dict)."""
    check_prompt_column(train_dataset, "train_dataset", trainer, prompt_optional)
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    for key, dataset in named:
        name = "eval_dataset" if key is None else f"eval_dataset[{key!r}]"
        check_prompt_column(dataset, name, trainer, prompt_optional)


def check_prompt_column(dataset, name: str, trainer: str, prompt_optional: bool = False) -> None:
    """An error naming the columns found and the fix when `dataset` is a DatasetDict or has no 'prompt' column (unless
    `prompt_optional`: GRPO's environments may produce the prompt). A dataset whose columns cannot be read passes."""
    if dataset is None:
        return
    columns = dataset_columns(dataset)
    if isinstance(columns, dict):  # a DatasetDict passed where a split was expected
        raise ValueError(
            f"{name} is a DatasetDict with splits {sorted(columns)}; pass one split, e.g. {name}=dataset['train']."
        )
    if columns is None or prompt_optional or "prompt" in columns:
        return
    columns = list(columns)
    source = next((column for column in PROMPT_LIKE if column in columns), columns[0] if columns else "question")
    raise ValueError(
        f"{name} has columns {columns} but {trainer} needs a 'prompt' column (a string, or a list of chat messages); "
        f"its other columns reach the reward functions by name. Rename the column holding the prompts, e.g. "
        f"dataset = dataset.rename_column({source!r}, 'prompt'), or build it with "
        f"dataset.map(lambda row: {{'prompt': ...}})."
    )


def report_dropped_rows(prepared, original, describe, when_all: str, when_some: str) -> None:
    """After TRL's preparation of `original` into `prepared` (both map-style datasets, else nothing is counted): an
    error when it left out every row, a warning when it left out some. `describe(dropped, total)` says which rows
    went and why; `when_all` (after ", so nothing is left to train on. ") and `when_some` end the message."""
    if not isinstance(prepared, Dataset) or not isinstance(original, Dataset):
        return
    dropped = len(original) - len(prepared)
    if dropped <= 0:
        return
    message = describe(dropped, len(original))
    if dropped == len(original):
        raise ValueError(f"{message}, so nothing is left to train on. {when_all}")
    # the caller's caller is the trainer's `_prepare_dataset`; the warning points at the user's constructor call
    warnings.warn(f"{message}{when_some}", UserWarning, stacklevel=5)
