"""BCO's underlying distribution matching (UDM) around the datasets, on with an `embedding_func` and an
`embedding_tokenizer` (TRL 0.2x's arguments).

The prompts are rendered as TRL 0.2x rendered them (a conversational prompt through the chat template, with the
generation prompt), tokenised by `embedding_tokenizer` (truncation on, no special tokens added), right-padded and
embedded by `embedding_func(input_ids=..., attention_mask=...)` -> [batch, dim] under no_grad. The classifier
(density_ratio.py) is fit once, on up to `prompt_sample_size` prompts per label of the prepared train dataset; then
every dataset gets each row's loss weight in a `udm_weight` column (1 for thumbs-up rows, the clamped density ratio
for thumbs-down ones), which the collator carries into the batch. The weights are thus computed once per dataset,
before any chunk plan, and every chunk of a micro-batch reads the same ones.

Differences from TRL 0.2x, each for a reason: the sample is drawn without replacement with a generator seeded by
`args.seed` (TRL drew with replacement from numpy's global state), so the classifier is the same on every process and
on a resumed run, and no classifier file is needed in checkpoints; only thumbs-down prompts are embedded for the
weights (the thumbs-up weight is 1 whatever their embedding).
"""

from __future__ import annotations

import logging

import torch
from datasets import Dataset
from trl.data_utils import maybe_apply_chat_template

from slimrl.trainers.bco.density_ratio import (
    ClassifierFitError,
    DensityRatioClassifier,
    fit_density_ratio_classifier,
    udm_weights,
)

logger = logging.getLogger(__name__)

WEIGHT_COLUMN = "udm_weight"
WEIGHT_ROWS_PER_PASS = 4096  # thumbs-down prompts embedded per pass when weighting a dataset: bounds host memory
DROP_UDM = "or drop embedding_func and embedding_tokenizer to train plain BCO"


class PromptEmbedder:
    """Prompts -> [n, dim] float32 embeddings on the CPU, `batch_size` prompts per call of `embedding_func`."""

    def __init__(self, embedding_func, embedding_tokenizer, processing_class, batch_size: int, device):
        self.func, self.tokenizer, self.processing_class = embedding_func, embedding_tokenizer, processing_class
        self.batch_size, self.device = batch_size, device
        self.pad_id = embedding_tokenizer.pad_token_id if embedding_tokenizer.pad_token_id is not None else 0

    def text(self, prompt) -> str:
        return maybe_apply_chat_template({"prompt": prompt}, self.processing_class)["prompt"]

    def __call__(self, prompts: list) -> torch.Tensor:
        parts = []
        for start in range(0, len(prompts), self.batch_size):
            input_ids, attention_mask = self.padded_ids(prompts[start : start + self.batch_size])
            with torch.no_grad():
                embeddings = self.func(input_ids=input_ids, attention_mask=attention_mask)
            check_embeddings(embeddings, len(input_ids), parts[0].size(1) if parts else None)
            parts.append(embeddings.detach().float().cpu())
        return torch.cat(parts) if parts else torch.empty(0, 0)

    def padded_ids(self, prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) [b, longest] on the device: the rendered prompts' embedding_tokenizer ids,
        right-padded with its pad id."""
        texts = [self.text(prompt) for prompt in prompts]
        ids = self.tokenizer(texts, truncation=True, add_special_tokens=False)["input_ids"]
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)


def check_embeddings(embeddings, num_prompts: int, width: int | None) -> None:
    """One fixed-width embedding per prompt: [num_prompts, dim], dim the same as the earlier batches' (`width`)."""
    if isinstance(embeddings, torch.Tensor) and embeddings.dim() == 2 and embeddings.size(0) == num_prompts:
        if width is None or embeddings.size(1) == width:
            return
    shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else type(embeddings).__name__
    earlier = f" after [batch, {width}]" if width is not None else ""
    raise ValueError(f"embedding_func must return one embedding per prompt, a [batch, dim] tensor with the same dim "
                     f"for every batch; for {num_prompts} prompts it returned {shape}{earlier}. Pool the token states "
                     "(e.g. a masked mean over attention_mask) inside embedding_func.")  # fmt: skip


def fit_classifier(dataset, embed: PromptEmbedder, args) -> DensityRatioClassifier:
    """The density-ratio classifier, fit on up to `args.prompt_sample_size` prompts per label of the prepared train
    `dataset`, sampled with a generator seeded by `args.seed`."""
    check_map_style(dataset, "train_dataset")
    labels = torch.tensor(dataset["label"]).bool().reshape(-1)
    num_up = int(labels.sum().item())
    if num_up in (0, labels.numel()):
        raise ValueError(
            "BCO's density-ratio matching (embedding_func) fits a classifier telling the thumbs-up prompts of "
            f"train_dataset from the thumbs-down ones, but train_dataset has {num_up} thumbs-up and "
            f"{labels.numel() - num_up} thumbs-down rows. Add rows of the missing label, {DROP_UDM}."
        )
    generator = torch.Generator().manual_seed(args.seed)
    sample = {}
    for label in (True, False):
        rows = (labels == label).nonzero().flatten()
        picked = rows[torch.randperm(rows.numel(), generator=generator)[: args.prompt_sample_size]]
        sample[label] = embed(dataset.select(picked.sort().values.tolist())["prompt"])
    embeddings = torch.cat([sample[True], sample[False]])
    desirable = torch.cat([torch.ones(len(sample[True])), torch.zeros(len(sample[False]))]).bool()
    try:
        classifier = fit_density_ratio_classifier(embeddings, desirable)
    except ClassifierFitError as error:
        raise ValueError(f"BCO's density-ratio classifier could not be fit to the prompt embeddings: {error}. Check "
                         f"what embedding_func returns, {DROP_UDM}.") from error  # fmt: skip
    logger.info("UDM classifier training accuracy: thumbs-up %.4f, thumbs-down %.4f (%d + %d prompts)",
                classifier.accuracy(sample[True], True), classifier.accuracy(sample[False], False),
                len(sample[True]), len(sample[False]))  # fmt: skip
    return classifier


def with_weights(dataset, classifier: DensityRatioClassifier, embed: PromptEmbedder, args, dataset_name: str):
    """`dataset` with its `udm_weight` column (re)computed: 1 for a thumbs-up row, the thumbs-down rows' density
    ratio clamped to [args.min_density_ratio, args.max_density_ratio]."""
    check_map_style(dataset, f"the {dataset_name} dataset")
    if WEIGHT_COLUMN in dataset.column_names:  # a dataset prepared before (evaluate re-prepares what it is given)
        dataset = dataset.remove_columns(WEIGHT_COLUMN)
    labels = torch.tensor(dataset["label"]).bool().reshape(-1)
    weights = torch.ones(labels.numel(), dtype=torch.float64)
    undesirable = (~labels).nonzero().flatten()
    for start in range(0, undesirable.numel(), WEIGHT_ROWS_PER_PASS):
        rows = undesirable[start : start + WEIGHT_ROWS_PER_PASS]
        prob = classifier.prob_desirable(embed(dataset.select(rows.tolist())["prompt"]))
        weights[rows] = udm_weights(prob, torch.zeros_like(prob, dtype=torch.bool), args.min_density_ratio,
                                    args.max_density_ratio)  # fmt: skip
    return dataset.add_column(WEIGHT_COLUMN, weights.tolist())


def check_map_style(dataset, name: str) -> None:
    if not isinstance(dataset, Dataset):
        raise ValueError(f"{name} ({type(dataset).__name__}) is not a map-style datasets.Dataset: BCO's density-ratio "
                         "matching samples and weights its prompts before training. Load it without streaming "
                         f"(streaming=False), {DROP_UDM}.")  # fmt: skip


class WithUDMWeights:
    """A data collator plus each example's `udm_weight` as a float32 [N] tensor (TRL's collators drop the column)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        if examples and WEIGHT_COLUMN in examples[0]:
            batch[WEIGHT_COLUMN] = torch.tensor([example[WEIGHT_COLUMN] for example in examples], dtype=torch.float32)
        return batch
