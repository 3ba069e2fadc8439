"""BCO's input checks: the dataset columns and labels, the density-ratio matching arguments (both or neither), and
the constructor arguments of TRL 0.2x's BCOTrainer that slimrl does not support, each refused with the change to make
(TRL would fail later with a bare KeyError, or run without the feature)."""

from __future__ import annotations

from datasets import Dataset, IterableDataset

from slimrl.trainers.common.preference_inputs import IMAGE_COLUMNS, check_boolean_labels, dataset_columns

FORMAT = ("BCO needs an unpaired dataset with 'prompt', 'completion' and a boolean 'label' column (True for a "
          "thumbs-up completion, False for a thumbs-down one)")  # fmt: skip


def check_datasets(train_dataset, eval_dataset) -> None:
    """`check_dataset` on the train dataset and on each eval dataset (a dict of them is evaluated split by split)."""
    if train_dataset is None:
        raise ValueError(f"BCOTrainer needs a train_dataset. {FORMAT}.")
    check_dataset(train_dataset, "train_dataset")
    named = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    for key, dataset in named:
        check_dataset(dataset, "eval_dataset" if key is None else f"eval_dataset[{key!r}]")


def check_dataset(dataset, name: str) -> None:
    """The columns and labels BCO reads, checked before TRL's preparation fails on them with a bare error."""
    if not isinstance(dataset, (Dataset, IterableDataset)):
        return  # None, or a type TRL itself rejects with its own message
    columns = dataset_columns(dataset)  # from the schema, or an IterableDataset's first example
    if "chosen" in columns or "rejected" in columns:
        raise ValueError(
            f"{name} has paired columns {columns}. {FORMAT}; split each pair into a thumbs-up and a thumbs-down row "
            f"first: {name} = trl.data_utils.unpair_preference_dataset({name})."
        )
    images = [column for column in IMAGE_COLUMNS if column in columns]
    if images:
        raise ValueError(f"{name} has image columns {images}: slimrl's BCOTrainer trains text-only models. Drop "
                         f"them ({name}.remove_columns({images})) or use a text dataset.")  # fmt: skip
    missing = [column for column in ("prompt", "completion", "label") if column not in columns]
    if missing:
        raise ValueError(f"{name} has columns {columns}, without {missing}. {FORMAT}.")
    check_boolean_labels(dataset, name, "BCO", "thumbs-up", "thumbs-down")


def check_udm_arguments(embedding_func, embedding_tokenizer) -> None:
    """Density-ratio matching (UDM) needs both the embedding function and the tokenizer that feeds it."""
    if (embedding_func is None) != (embedding_tokenizer is None):
        given, missing = ("embedding_func", "embedding_tokenizer") if embedding_tokenizer is None else \
            ("embedding_tokenizer", "embedding_func")  # fmt: skip
        raise ValueError(
            f"BCO's density-ratio matching (UDM) needs both embedding_func and embedding_tokenizer; only {given} was "
            f"given. Pass {missing} too (embedding_func(input_ids=..., attention_mask=...) embeds the ids "
            f"embedding_tokenizer makes of each prompt), or drop {given} to train plain BCO (every example weighted 1)."
        )
    if embedding_func is not None and not callable(embedding_func):
        raise ValueError(f"embedding_func must be a function of (input_ids, attention_mask) returning one embedding "
                         f"per prompt, a [batch, dim] tensor; got a {type(embedding_func).__name__}.")  # fmt: skip


def check_unsupported_arguments(model_init, preprocess_logits_for_metrics, model_adapter_name,
                                ref_adapter_name) -> None:  # fmt: skip
    """TRL 0.2x BCOTrainer arguments slimrl does not support: an error naming each and what to do instead."""
    if model_init is not None:
        raise ValueError("model_init is not supported by slimrl's BCOTrainer; pass the model itself as `model`.")
    if preprocess_logits_for_metrics is not None:
        raise ValueError("preprocess_logits_for_metrics is not supported: BCO never builds the [B, T, V] logits. "
                         "Use the logged metrics (rewards/*, logps/*, logits/*, delta).")  # fmt: skip
    if model_adapter_name not in (None, "default"):
        raise ValueError(f"model_adapter_name={model_adapter_name!r}: slimrl trains the active adapter; make it "
                         "active with model.set_adapter(...) and leave model_adapter_name unset.")  # fmt: skip
    if ref_adapter_name not in (None, "ref"):
        raise ValueError(f"ref_adapter_name={ref_adapter_name!r}: the reference adapter must be named 'ref' (TRL "
                         "1.16's convention), or leave it unset for the policy with its adapter off.")  # fmt: skip
