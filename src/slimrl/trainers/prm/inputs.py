"""A PRM dataset row as token ids and per-token labels, the checks before tokenising, and the collator.

A row is `prompt` (a string), `completions` (the reasoning steps, strings) and `labels` (one bool per step: is the
step correct). Tokenised as TRL's PRMTrainer tokenised it:

    [BOS] prompt | step 1 + separator | step 2 + separator | ...
    -100 ...     | -100 ... label 1   | -100 ... label 2   | ...

the label of a step on the last token of the separator after it, -100 (ignored by the loss) everywhere else. Then
the prompt keeps its last `max_prompt_length` tokens, the completion its first `max_completion_length`, and the
row its first `max_length`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimrl.trainers.common.preference_inputs import dataset_columns

IGNORE_INDEX = -100  # a position without a label: cross-entropy leaves it out
ROW_COLUMNS = ("prompt", "completions", "labels")
TOKENISED_COLUMNS = ("input_ids", "labels")


def tokenize_row(features: dict, tokenizer, step_separator: str, max_length: int | None, max_prompt_length: int | None,
                 max_completion_length: int | None, train_on_last_step_only: bool,
                 is_eval: bool) -> dict[str, list[int]]:  # fmt: skip
    """{"input_ids", "labels"} of one row (module docstring). `train_on_last_step_only` keeps only the last step's
    label, in training rows (`is_eval=False`) only."""
    prompt, steps, step_labels = features["prompt"], features["completions"], features["labels"]
    check_row(prompt, steps, step_labels)
    separator = tokenizer.encode(step_separator, add_special_tokens=False)
    if not separator:
        raise ValueError(f"step_separator {step_separator!r} tokenises to no tokens, so no token can carry a step's "
                         "label; choose a separator the tokenizer encodes, e.g. '\\n'.")  # fmt: skip
    targets = [int(label) for label in step_labels]
    if train_on_last_step_only and not is_eval:
        targets = [IGNORE_INDEX] * (len(targets) - 1) + targets[-1:]
    completion_ids, completion_labels = [], []
    for step, target in zip(steps, targets, strict=True):
        ids = tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        completion_ids += ids
        completion_labels += [IGNORE_INDEX] * (len(ids) - 1) + [target]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id, *prompt_ids]
    if max_prompt_length is not None:  # the prompt's end is nearest the steps: keep it
        prompt_ids = prompt_ids[max(0, len(prompt_ids) - max_prompt_length):]
    if max_completion_length is not None:
        completion_ids, completion_labels = completion_ids[:max_completion_length], \
            completion_labels[:max_completion_length]  # fmt: skip
    input_ids = prompt_ids + completion_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + completion_labels
    if max_length is not None:
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def check_row(prompt, steps, labels) -> None:
    """An error naming the problem and the fix for a row `tokenize_row` cannot read."""
    if not isinstance(prompt, str):
        raise ValueError(f"PRM rows need a string 'prompt', got {type(prompt).__name__}: {str(prompt)[:60]!r}. Apply "
                         "the chat template first if the prompt is a list of messages.")  # fmt: skip
    if isinstance(steps, str) or not isinstance(steps, (list, tuple)) or not steps:
        raise ValueError(f"'completions' must be a non-empty list of step strings, got {str(steps)[:60]!r} (prompt "
                         f"{prompt[:40]!r}). Split the reasoning into steps: ['step 1', 'step 2', ...].")  # fmt: skip
    if not isinstance(labels, (list, tuple)) or len(labels) != len(steps):
        count = len(labels) if isinstance(labels, (list, tuple)) else type(labels).__name__
        raise ValueError(f"A row has {len(steps)} steps in 'completions' but {count} values in 'labels' (prompt "
                         f"{prompt[:40]!r}); give exactly one label per step (True: the step is correct).")  # fmt: skip
    bad = [label for label in labels if not (isinstance(label, bool) or label in (0, 1))]
    if bad:
        raise ValueError(f"'labels' holds {bad[0]!r}; each step's label is a bool (True: correct) or 0/1 (prompt "
                         f"{prompt[:40]!r}).")  # fmt: skip


def check_prm_columns(dataset, name: str) -> bool:
    """Whether `dataset` is already tokenised (input_ids and labels, used as they are); an error naming the columns
    found and the ones needed when it is neither tokenised nor PRM rows. A dataset whose columns cannot be read
    passes (as rows)."""
    columns = dataset_columns(dataset)
    if isinstance(columns, dict):
        raise ValueError(f"{name} is a DatasetDict with splits {sorted(columns)}; pass one split, e.g. "
                         f"{name}=dataset['train'].")  # fmt: skip
    if columns is None:
        return False
    if "input_ids" in columns:
        if "labels" not in columns:
            raise ValueError(f"{name} is tokenised ('input_ids') but has no 'labels' column (per token: 0/1 on each "
                             "step's separator, -100 elsewhere). Pass the untokenised rows instead: prompt, "
                             "completions, labels.")  # fmt: skip
        return True
    missing = [column for column in ROW_COLUMNS if column not in columns]
    if missing:
        raise ValueError(f"{name} has columns {list(columns)} but PRMTrainer needs {list(ROW_COLUMNS)}: 'prompt' (a "
                         "string), 'completions' (the reasoning steps, a list of strings) and 'labels' (one bool per "
                         f"step). Missing: {missing}; rename or build them with dataset.map.")  # fmt: skip
    return False


@dataclass
class PRMCollator:
    """Tokenised rows -> right-padded `input_ids`, `attention_mask` and `labels` [N, T] (labels padded with -100).
    Right padding keeps each row's positions whatever the batch, so a chunk cut to its rows' width is exact."""

    pad_token_id: int

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(feature["input_ids"]) for feature in features)
        input_ids = torch.full((len(features), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, feature in enumerate(features):
            length = len(feature["input_ids"])
            input_ids[row, :length] = torch.as_tensor(feature["input_ids"], dtype=torch.long)
            labels[row, :length] = torch.as_tensor(feature["labels"], dtype=torch.long)
            attention_mask[row, :length] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
