"""What slimrl's RewardTrainer checks in its datasets that TRL lets through to a KeyError inside `Dataset.map`, or to
pairs it drops without a word: each check is an error (or a warning) naming the fix."""

from __future__ import annotations

from datasets import Dataset
from trl.data_utils import get_dataset_column_names

from slimrl.trainers.common.dataset_checks import report_dropped_rows

PAIRED_COLUMNS = (("chosen", "rejected"), ("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids"))


def check_reward_columns(dataset, name: str) -> None:
    """An error when the dataset holds no chosen/rejected pairs TRL's preparation can read."""
    if isinstance(dataset, Dataset) and len(dataset) == 0:
        raise ValueError(f"The {name} dataset is empty; a reward model needs at least one chosen/rejected pair.")
    columns = get_dataset_column_names(dataset)
    if any(chosen in columns and rejected in columns for chosen, rejected in PAIRED_COLUMNS):
        return
    if "completion" in columns and "label" in columns:
        hint = (" It looks like an unpaired preference dataset (completion + label, as KTO uses); pair each "
                "prompt's desirable and undesirable completions into 'chosen' and 'rejected'.")  # fmt: skip
    elif "chosen" in columns or "rejected" in columns:
        missing = "rejected" if "chosen" in columns else "chosen"
        hint = f" The '{missing}' column is missing."
    else:
        hint = " Rename the columns holding the preferred and the dispreferred answer to 'chosen' and 'rejected'."
    raise ValueError(
        f"The {name} dataset has columns {columns}, but a reward model trains on pairs: it needs 'chosen' and "
        "'rejected' columns (texts, or lists of chat messages; an optional 'prompt' column is put before both), or "
        f"pre-tokenized 'chosen_ids' and 'rejected_ids'.{hint}"
    )


def check_pairs_kept(prepared, original, name: str, max_length: int | None) -> None:
    """TRL does not truncate preference pairs: it drops every pair whose chosen or rejected sequence is longer than
    max_length, silently. A warning when some went, an error when all did."""
    if max_length is None:
        return
    report_dropped_rows(
        prepared,
        original,
        lambda dropped, total: f"{dropped} of the {total} pairs of the {name} dataset have a chosen or rejected "
        f"sequence longer than max_length={max_length}; TRL does not truncate pairs, it leaves them out",
        when_all="Raise max_length, or set max_length=None.",
        when_some=". Raise max_length to keep them.",
    )
