"""BCO's dataset preparation around TRL 1.16's KTO one: TRL tokenises (chat template, EOS, prompt/completion split);
BCO then cuts the prompt to max_prompt_length and the completion to max_completion_length (TRL 0.2x's settings), and
only then drops the examples whose prompt alone still fills max_length, saying how many it dropped (TRL drops them
silently, before any prompt could be cut)."""

from __future__ import annotations

import contextlib
import logging

from datasets import Dataset

from slimrl.trainers.common.dataset_checks import report_dropped_rows


class WithoutDrop:
    """`args` as TRL's preparation reads them, with max_length None: TRL's drop of long prompts is deferred until
    BCO has cut them."""

    max_length = None

    def __init__(self, args):
        self._args = args

    def __getattr__(self, name):
        return getattr(self._args, name)


def truncate(dataset, args, dataset_name: str):
    """The tokenised `dataset` with each prompt cut to max_prompt_length tokens (its last ones with truncation_mode
    'keep_end', its first with 'keep_start') and each completion to its first max_completion_length tokens; then the
    examples whose prompt fills max_length dropped (no completion token would remain)."""
    prompt_limit, completion_limit = args.max_prompt_length, args.max_completion_length
    keep_end = args.truncation_mode == "keep_end"

    def cut(example):
        prompt, completion = example["prompt_ids"], example["completion_ids"]
        if prompt_limit is not None and len(prompt) > prompt_limit:
            prompt = prompt[-prompt_limit:] if keep_end else prompt[:prompt_limit]
        if completion_limit is not None:
            completion = completion[:completion_limit]
        return {"prompt_ids": prompt, "completion_ids": completion}

    if prompt_limit is not None or completion_limit is not None:
        dataset = dataset.map(cut, **_described(dataset, f"Truncating {dataset_name} dataset"))
    if args.max_length is None:
        return dataset
    described = _described(dataset, f"Dropping fully truncated examples from {dataset_name} dataset")
    return dataset.filter(lambda example: len(example["prompt_ids"]) < args.max_length, **described)


def report_dropped(prepared, original, args, dataset_name: str) -> None:
    """An error when every example of `original` was dropped for a prompt filling max_length, a warning when some
    were (map-style datasets only)."""
    report_dropped_rows(
        prepared,
        original,
        lambda dropped, total: (
            f"{dropped} of {total} examples of the {dataset_name} dataset were dropped because "
            f"their prompt alone has at least max_length={args.max_length} tokens"
        ),
        "Raise max_length in BCOConfig, or set max_prompt_length below it to cut long prompts.",
        ". Raise max_length in BCOConfig, or set max_prompt_length below it, to keep them.",
    )


def _described(dataset, description: str) -> dict:
    return {"desc": description} if isinstance(dataset, Dataset) else {}  # IterableDataset.map takes no desc


@contextlib.contextmanager
def without_kto_weight_advice(module: str):
    """TRL's KTO preparation (logger `module`) advises desirable_weight / undesirable_weight for unbalanced labels;
    BCO has no such weights, so that log line is dropped."""
    trl_logger = logging.getLogger(module)
    drop = lambda record: "desirable_weight" not in record.getMessage()  # noqa: E731
    trl_logger.addFilter(drop)
    try:
        yield
    finally:
        trl_logger.removeFilter(drop)
