"""What slimrl's SFTTrainer checks in its datasets that TRL lets through to a KeyError deep inside `Dataset.map`, or
to a run that silently trains on something else than asked: each check is an error (or a warning) naming the fix."""

from __future__ import annotations

from datasets import Dataset
from trl.data_utils import get_dataset_column_names, is_conversational, is_conversational_from_value

from slimrl.trainers.common.dataset_checks import report_dropped_rows

SFT_FORMATS = (
    "a '{text}' column of plain text (or set dataset_text_field to the column that holds it)",
    "a 'messages' column of chat messages (lists of {{'role': ..., 'content': ...}} dicts)",
    "'prompt' and 'completion' columns (texts, or lists of chat messages)",
    "a pre-tokenized 'input_ids' column (with optional 'labels')",
)


def check_not_empty(dataset, name: str) -> None:
    """TRL reads the first example of every dataset; an empty one would stop it with a bare StopIteration."""
    if isinstance(dataset, Dataset) and len(dataset) == 0:
        raise ValueError(f"The {name} dataset is empty; SFT needs at least one example.")


def check_sft_columns(dataset, name: str, text_field: str, has_formatting_func: bool) -> None:
    """An error when TRL's preparation would look for a column the dataset lacks (it raises a bare KeyError from
    inside `Dataset.map`)."""
    check_not_empty(dataset, name)
    columns = get_dataset_column_names(dataset)
    if "input_ids" in columns or has_formatting_func:
        return
    example = next(iter(dataset))
    if "prompt" in columns or "completion" in columns:
        missing = "completion" if "prompt" in columns else "prompt"
        if missing not in columns:
            raise ValueError(
                f"The {name} dataset has columns {columns}: a prompt-completion dataset needs both 'prompt' and "
                f"'completion', and '{missing}' is missing. Add it (or rename the column that holds it), or put the "
                "whole text in one 'text' column to train on all of it."
            )
        return
    if is_conversational(example) or is_conversational_from_value(example) or text_field in columns:
        return
    needs = "; ".join(form.format(text=text_field) for form in SFT_FORMATS)
    hint = ""
    if "messages" in columns:
        hint = " Its 'messages' column does not hold chat messages (dicts with 'role' and 'content')."
    raise ValueError(
        f"The {name} dataset has columns {columns}, none of which SFT knows how to train on.{hint} SFT needs one "
        f"of: {needs}. Rename the column that holds your data (e.g. dataset.rename_column('{columns[0]}', "
        f"'{text_field}') for plain text), or pass formatting_func=lambda example: ... returning the text."
    )


def check_preparation_kept_examples(prepared, original, name: str, max_length: int | None, packing: bool) -> None:
    """TRL truncates to max_length and then drops examples left with no loss token (e.g. a prompt longer than
    max_length under completion-only loss) without a word: a warning when some went, an error when all did."""
    if packing or max_length is None:
        return
    report_dropped_rows(
        prepared,
        original,
        lambda dropped, total: f"{dropped} of the {total} examples of the {name} dataset kept no token to train on "
        f"after truncation to max_length={max_length} (their loss tokens, e.g. the completion, all lie past it)",
        when_all="Raise max_length, or shorten the prompts.",
        when_some="; they are left out. Raise max_length to keep them.",
    )


def check_pretokenized_lengths(dataset, name: str, max_length: int | None) -> None:
    """With `skip_prepare_dataset=True` TRL neither truncates nor checks: sequences past max_length would train at
    full length, beyond what the run was configured (and sized) for."""
    if max_length is None or not isinstance(dataset, Dataset) or "input_ids" not in dataset.column_names:
        return
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.with_format("arrow")[:]["input_ids"])
    longest = pc.max(lengths).as_py() or 0
    if longest > max_length:
        count = pc.sum(pc.greater(lengths, max_length)).as_py()
        raise ValueError(
            f"{count} examples of the {name} dataset are longer than max_length={max_length} (the longest has "
            f"{longest} tokens), and skip_prepare_dataset=True skips TRL's truncation. Truncate 'input_ids' (and "
            "'labels') to max_length yourself, raise max_length, or set max_length=None to train at full length."
        )
