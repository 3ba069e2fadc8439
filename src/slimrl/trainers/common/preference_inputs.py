"""What slimrl checks in a preference dataset (prompt / chosen / rejected) that TRL lets through to a later crash or a
silent mis-training: missing columns, a mix of plain-text and chat-message columns, and sequences the model's context
cannot hold; and the boolean labels of an unpaired dataset (KTO, BCO)."""

from __future__ import annotations

import numbers
import warnings

from datasets import Dataset

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
REQUIRED_COLUMNS = ("chosen", "rejected")  # without "prompt", TRL takes the common prefix of chosen and rejected
IMAGE_COLUMNS = ("image", "images")


def dataset_columns(dataset) -> list[str] | None:
    """A dataset's column names, from its schema or else its first row (streaming datasets may have no schema)."""
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        first = next(iter(dataset), None)
        columns = list(first) if isinstance(first, dict) else None
    return columns


def check_boolean_labels(dataset, name: str, algorithm: str, good: str, bad: str) -> None:
    """An unpaired dataset's 'label' column must hold booleans (0 and 1 read as False and True, as TRL reads them):
    every distinct label of a Dataset, the first row's of a streaming one. good / bad: what True and False mean to
    the algorithm's users ("desirable" / "undesirable" for KTO), named in the error."""
    if isinstance(dataset, Dataset):
        values = dataset.unique("label") if len(dataset) else []
    else:
        values = [next(iter(dataset))["label"]]
    wrong = [value for value in values if not (isinstance(value, numbers.Real) and value in (0, 1))]
    if wrong:
        shown = ", ".join(f"{value!r} ({type(value).__name__})" for value in wrong[:3])
        raise ValueError(
            f"{name}'s 'label' column holds {shown}; {algorithm} needs a boolean label per row: True for a {good} "
            f"completion, False for {'an' if bad[0] in 'aeiou' else 'a'} {bad} one. Convert it first, e.g. "
            f"dataset = dataset.map(lambda row: {{'label': row['label'] == 'good'}}) with your {good} value."
        )


def check_preference_dataset(dataset, name: str, algorithm: str = "DPO") -> None:
    """An error naming the fix when `dataset` lacks the columns a preference trainer needs, or mixes formats."""
    columns = dataset_columns(dataset)
    if isinstance(columns, dict):  # a DatasetDict passed where a split was expected
        raise ValueError(
            f"{name} is a DatasetDict with splits {sorted(columns)}; pass one split, e.g. {name}=dataset['train']."
        )
    if columns is None:
        return
    needed = REQUIRED_COLUMNS + (("prompt",) if any(c in columns for c in IMAGE_COLUMNS) else ())
    missing = [column for column in needed if column not in columns]
    if missing:
        raise ValueError(
            f"{name} has columns {list(columns)} but {algorithm} needs {', '.join(repr(c) for c in needed)} columns "
            f"(plus an optional 'prompt'; without it the prompt is the shared start of chosen and rejected); "
            f"{', '.join(repr(c) for c in missing)} {'is' if len(missing) == 1 else 'are'} missing. Rename the columns "
            f"holding the preferred and dispreferred answers, e.g. dataset.rename_columns({{'good': 'chosen', "
            f"'bad': 'rejected'}})."
        )
    first = next(iter(dataset), None)
    if isinstance(first, dict):
        check_pair_formats(first, name)


def value_format(value) -> str:
    """'conversational' (a list of {'role', 'content'} messages), 'standard' (a string) or a description."""
    if isinstance(value, str):
        return "standard"
    if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
        return "conversational"
    return f"a {type(value).__name__}" + (" of " + type(value[0]).__name__ if isinstance(value, list) and value else "")


def check_pair_formats(example: dict, name: str) -> None:
    """prompt, chosen and rejected must all be strings or all be lists of chat messages (TRL reads the format from one
    of them, picked arbitrarily, and fails later on the others)."""
    formats = {column: value_format(example[column]) for column in PAIR_COLUMNS if column in example}
    odd = {column: kind for column, kind in formats.items() if kind not in ("standard", "conversational")}
    if odd:
        raise ValueError(
            f"{name}: column(s) {', '.join(f'{c!r} holds {k}' for c, k in odd.items())}; each of "
            f"{', '.join(repr(c) for c in formats)} must be a string (standard format) or a list of "
            "{'role': ..., 'content': ...} messages (conversational format)."
        )
    if len(set(formats.values())) > 1:
        described = ", ".join(f"{column!r} is {kind}" for column, kind in formats.items())
        raise ValueError(
            f"{name} mixes formats in its first row: {described}. Use one format for all of "
            f"{', '.join(repr(c) for c in formats)}: plain strings, or lists of chat messages (e.g. a prompt "
            "[{'role': 'user', 'content': ...}] with chosen/rejected [{'role': 'assistant', 'content': ...}])."
        )


def longest_pair_sequence(dataset) -> int:
    """The longest prompt+chosen or prompt+rejected sequence of a tokenized preference dataset (map-style)."""
    import pyarrow.compute as pc

    longest = 0
    arrow = dataset.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).with_format("arrow")
    for table in arrow.iter(batch_size=65536):
        prompt = pc.list_value_length(table["prompt_ids"])
        for completion in ("chosen_ids", "rejected_ids"):
            lengths = pc.add(prompt, pc.list_value_length(table[completion]))
            longest = max(longest, pc.max(lengths).as_py() or 0)
    return longest


def check_sequence_lengths(model, dataset, name: str, max_length: int | None) -> None:
    """An error when a sequence the trainer will feed the model (after truncation to `max_length`, if any) does not
    fit the context slimrl was told to size for (FastLanguageModel's max_seq_length); a warning when it only passes
    the model's max_position_embeddings, which transformers' RoPE runs past as TRL does."""
    limit = getattr(getattr(model, "slimrl_options", None), "max_seq_length", None)
    where = "max_seq_length given to FastLanguageModel.from_pretrained"
    if limit is None:
        config = getattr(model, "config", None)
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        limit, where = getattr(text_config, "max_position_embeddings", None), "the model's max_position_embeddings"
    if limit is None or (max_length is not None and max_length <= limit):
        return  # every sequence is truncated to a length the model holds
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        return  # a streaming dataset: its lengths are not known up front
    if not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(dataset.column_names or ()):
        return
    longest = longest_pair_sequence(dataset)
    length = longest if max_length is None else min(longest, max_length)
    if length <= limit:
        return
    truncation = "max_length=None (no truncation)" if max_length is None else f"max_length={max_length}"
    message = (f"{name} has a prompt+completion of {length} tokens with {truncation}, beyond the model's context of "
               f"{limit} tokens ({where}). Set max_length={limit} (or lower) in the DPOConfig so sequences are "
               "truncated to fit, or drop the longest examples.")  # fmt: skip
    if where.startswith("max_seq_length"):
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=3)
