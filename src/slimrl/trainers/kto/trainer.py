"""slimrl's KTO trainer: TRL's KTOTrainer with a chunked training step and input validation.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; checks the dataset's columns and labels before TRL prepares it (TRL fails there with a
  bare KeyError or TypeError), and after TRL's own checks the loss type, the examples TRL dropped and the context.
- `compute_loss`: runs the micro-batch's sequences in chunks (only one chunk's activations alive at once). KTO couples
  the rows through the KL reference point and the mean over rows, so both are fixed for the whole micro-batch before
  the first chunk (the KL point from gradient-free passes over the mismatched completions, in chunks); the summed
  gradient is then TRL's. Logs TRL's metrics with TRL's names and values, assembled from the chunks' sums.
- `compute_ref_log_probs`: the precompute pass (`precompute_ref_log_probs`) scores its batches in the training step's
  chunk size, so it never holds more activations than a training chunk does.
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step;
batches the chunked step cannot split exactly (MoE auxiliary loss, vision inputs, `return_outputs=True`, inputs of a
custom collator) run through TRL's one-piece loss, with one warning per reason. Everything else is TRL's.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import trl
from datasets import Dataset, IterableDataset

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.preference_inputs import check_boolean_labels, dataset_columns
from slimrl.trainers.common.slim_fields import SlimFields, with_slim_fields
from slimrl.trainers.common.unpaired import chunk_stats, gathered_sums, reference_forward
from slimrl.trainers.kto.loss import (
    append_metrics,
    check_loss_type,
    kl_reference_point,
    label_weights,
    unpaired_losses,
)

__all__ = ["KTOConfig", "KTOTrainer"]

# What TRL's text collator puts in a batch; the chunked step knows how to split each of these by rows.
BATCH_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask",
                        "KL_completion_mask", "label", "ref_logps", "ref_KL_logps"})  # fmt: skip
STATS = "kto"  # the name of a chunk's metric sums (kto_loss.STAT_NAMES) in run_chunks' totals


@dataclass
class KTOConfig(SlimFields, trl.KTOConfig):
    """TRL's KTOConfig plus slimrl's settings (the shared ones in SlimFields)."""

    def __post_init__(self):
        check_loss_type(self.loss_type)
        super().__post_init__()


@dataclass(frozen=True)
class _MicroBatch(ChunkPlan):
    """What every chunk's share of the loss depends on, computed over the whole micro-batch before the first chunk.
    The chunks hold sequences grouped by length; the normaliser is N, TRL's loss being the mean over the rows."""

    desirable: torch.Tensor  # [N] bool
    ref_logps: torch.Tensor  # [N] reference completion log-probs
    kl: torch.Tensor  # KTO's reference point, detached (zeros(1) for the KL-free losses, as TRL)


class KTOTrainer(SlimTrainerMixin, ChunkedTrainerMixin, trl.KTOTrainer):
    """TRL's KTOTrainer whose training step runs in chunks of sequences. Same constructor, same results."""

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's KTOConfig named as TRL names it
        args = with_slim_fields(args, model, KTOConfig, "KTO")
        check_dataset(train_dataset, "train_dataset")
        splits = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
        for name, split in splits:
            check_dataset(split, name if name == "eval_dataset" else f"eval_dataset[{name!r}]")
        expected_rows = prepared_row_count(train_dataset)
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, quantization_config, peft_config)  # fmt: skip
        check_loss_type(self.loss_type)
        check_dropped_examples(self.train_dataset, expected_rows, self.args.max_length)
        check_context(self.model, self.train_dataset, self.args.max_length)
        self._apply_memory_savers()

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: a scalar loss whose backward() completes TRL's gradient (earlier chunks already backpropagated),
        # TRL's metrics appended to self._metrics[mode] once per micro-batch; (loss, outputs) via TRL's path
        # the batch's tensors on the accelerator's device, as TRL's get_batch_loss_metrics moves them
        batch = {k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        return self._loss_in_chunks_or_one_piece(model, batch, return_outputs, num_items_in_batch)

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's own one-piece loss, or None when chunking applies."""
        if return_outputs:
            return "return_outputs=True asks for the model outputs of the whole micro-batch"
        if self._is_vision_dataset:
            return "vision-language batches are not chunked yet"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss depends on all tokens of the micro-batch at once"
        unknown = sorted(set(inputs) - BATCH_KEYS)
        if unknown:
            return f"the batch carries inputs the chunked step does not split ({', '.join(unknown)})"
        return None

    def _plan_micro_batch(self, model, batch, mode: str, num_items_in_batch=None) -> _MicroBatch:
        """The chunk plan, the reference log-probs and the KL reference point, over the whole micro-batch."""
        device = batch["input_ids"].device
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)  # [N]
        lengths = sequence_lengths(batch, "")
        num_chunks = self._num_chunks_for(lengths.tolist(), device)
        chunks = plan_by_length(lengths, num_chunks, min_width=2)
        kl_chunks = plan_by_length(sequence_lengths(batch, "KL_"), num_chunks, min_width=2) if self.calculate_KL else []
        if self.precompute_ref_logps:
            ref_logps, ref_kl_logps = batch["ref_logps"], batch.get("ref_KL_logps")
        else:
            with reference_forward(self) as reference:
                ref_logps = self._sequence_logps(reference, batch, "", chunks)
                ref_kl_logps = self._sequence_logps(reference, batch, "KL_", kl_chunks) if self.calculate_KL else None
        kl = torch.zeros(1, device=device)
        if self.calculate_KL:
            with torch.no_grad():
                policy_kl_logps = self._sequence_logps(model, batch, "KL_", kl_chunks)  # [N]
            kl = kl_reference_point(policy_kl_logps, ref_kl_logps, self.accelerator.gather_for_metrics)
        return _MicroBatch(chunks, desirable.numel(), desirable, ref_logps.to(device), kl)

    def _chunk_loss(self, model, batch, plan: _MicroBatch, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its share of the metric sums."""
        outputs, logps, completion_mask = self._forward(model, batch, "", chunk)  # logps [b]
        rows = chunk.rows.to(logps.device)
        desirable = plan.desirable.index_select(0, rows)  # [b]
        logratios = logps - plan.ref_logps.index_select(0, rows)  # [b]
        losses = unpaired_losses(logratios, desirable, plan.kl, self.beta, self.loss_type)  # [b]
        weights = label_weights(desirable, self.desirable_weight, self.undesirable_weight, losses.dtype)  # [b]
        loss = (weights * losses).sum() / plan.normaliser
        positions = chunk.width - 1  # shifted: position j predicts token j + 1
        stats = chunk_stats(logps, self.beta * logratios.detach(), desirable, outputs.entropy[:, -positions:],
                            outputs.mean_logits[:, -positions:], completion_mask[:, 1:])  # fmt: skip
        return loss, {STATS: stats}

    def _forward(self, model, batch, prefix: str, chunk: Chunk):
        """The chunk's rows of the `prefix` sequences ("" or "KL_") through `model`'s fused LM head: (outputs,
        completion log-probs [b], completion mask [b, width])."""
        rows = chunk.rows.to(batch[f"{prefix}input_ids"].device)
        input_ids, attention_mask, completion_mask = (
            batch[f"{prefix}{name}"].index_select(0, rows)[:, : chunk.width]
            for name in ("input_ids", "attention_mask", "completion_mask")
        )
        labels = input_ids.masked_fill(completion_mask == 0, -100)
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, labels=labels,
                        fused_lm_head=True)  # fmt: skip
        # prompt-learning PEFT prepends virtual positions: keep those of the real tokens, as TRL does
        logps = outputs.log_probs[:, -(chunk.width - 1) :].sum(-1)
        return outputs, logps, completion_mask

    def _sequence_logps(self, model, batch, prefix: str, chunks: list[Chunk]) -> torch.Tensor:
        """Completion log-probs [N] of every `prefix` sequence, chunk by chunk; call under no_grad."""
        logps = None
        for chunk in chunks:
            chunk_logps = self._forward(model, batch, prefix, chunk)[1]
            if logps is None:
                logps = chunk_logps.new_zeros(batch[f"{prefix}input_ids"].size(0))
            logps.index_copy_(0, chunk.rows.to(logps.device), chunk_logps)
        return logps

    def _log_chunk_metrics(self, mode: str, batch, plan: _MicroBatch, totals: ChunkStats) -> None:
        """TRL's metrics of the micro-batch, every sum gathered across processes in one call."""
        sums = gathered_sums(self, mode, totals[STATS], plan.desirable, batch["attention_mask"])
        append_metrics(self._metrics[mode], plan.kl.item(), sums, self._total_train_tokens)

    # -- the precompute pass ---------------------------------------------------------------------------------------

    def compute_ref_log_probs(self, model, inputs):
        # contract: TRL's (reference completion log-probs [B], KL log-probs [B] or None) with the same values; only
        # how many rows one forward holds changes
        lengths = sequence_lengths(inputs, "")
        num_chunks = self._num_chunks_for(lengths.tolist(), inputs["input_ids"].device)
        if num_chunks <= 1 or set(inputs) - BATCH_KEYS:
            return super().compute_ref_log_probs(model, inputs)
        kl_lengths = sequence_lengths(inputs, "KL_") if "KL_input_ids" in inputs else None
        logps = kl_logps = None
        for chunk in plan_by_length(lengths, num_chunks, min_width=2):
            chunk_logps, chunk_kl_logps = super().compute_ref_log_probs(model, rows_of(inputs, chunk, kl_lengths))
            rows = chunk.rows.to(chunk_logps.device)
            if logps is None:
                logps = chunk_logps.new_zeros(lengths.numel())
                kl_logps = None if chunk_kl_logps is None else chunk_kl_logps.new_zeros(lengths.numel())
            logps.index_copy_(0, rows, chunk_logps)
            if kl_logps is not None:
                kl_logps.index_copy_(0, rows, chunk_kl_logps)
        return logps, kl_logps


# -- batches ---------------------------------------------------------------------------------------------------------


def sequence_lengths(batch, prefix: str) -> torch.Tensor:
    """[N] on the host: each `prefix` sequence's last attended (or completion) column + 1; the columns after it are
    right padding a chunk can drop."""
    mask = batch[f"{prefix}attention_mask"].bool() | batch[f"{prefix}completion_mask"].bool()
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return (mask * positions).amax(dim=1).cpu()


def rows_of(batch, chunk: Chunk, kl_lengths: torch.Tensor | None) -> dict:
    """The chunk's rows of a collated batch: the sequences cut to the chunk's width, the KL sequences to the longest
    among its rows."""
    kl_width = max(int(kl_lengths[chunk.rows].max()), 2) if kl_lengths is not None else None
    part = {}
    for key, value in batch.items():
        rows = value.index_select(0, chunk.rows.to(value.device))
        if key.startswith("KL_") and value.dim() == 2:
            rows = rows[:, :kl_width]
        elif key in ("input_ids", "attention_mask", "completion_mask"):
            rows = rows[:, : chunk.width]
        part[key] = rows
    return part


# -- input checks ----------------------------------------------------------------------------------------------------

FORMATS = ("KTO needs an unpaired dataset with 'prompt', 'completion' and a boolean 'label' column (True for a "
           "desirable completion, False for an undesirable one), or a paired preference dataset with 'chosen' and "
           "'rejected' columns (and 'prompt', or a prompt shared by both), which TRL unpairs")  # fmt: skip


def check_dataset(dataset, name: str) -> None:
    """The columns and labels TRL's dataset preparation reads, checked before it fails on them with a bare error."""
    if not isinstance(dataset, (Dataset, IterableDataset)):
        return  # None, or a type TRL itself rejects with its own message
    columns = dataset_columns(dataset)  # from the schema, or an IterableDataset's first example
    paired = [column for column in ("chosen", "rejected") if column in columns]
    if len(paired) == 2:
        return
    if paired:
        other = "rejected" if paired == ["chosen"] else "chosen"
        raise ValueError(f"{name} has a '{paired[0]}' column but no '{other}' column. {FORMATS}.")
    missing = [column for column in ("prompt", "completion", "label") if column not in columns]
    if missing:
        raise ValueError(f"{name} has columns {columns}, without {missing}. {FORMATS}.")
    check_boolean_labels(dataset, name, "KTO", "desirable", "undesirable")


def prepared_row_count(dataset) -> int | None:
    """How many rows TRL's preparation would give `dataset` if it dropped none (a paired row becomes two)."""
    if not isinstance(dataset, Dataset):
        return None
    paired = {"chosen", "rejected"} <= set(dataset.column_names)
    return len(dataset) * (2 if paired else 1)


def check_dropped_examples(dataset, expected_rows: int | None, max_length: int | None) -> None:
    """TRL silently drops the examples whose prompt alone fills max_length: say so, and fail when none is left."""
    if expected_rows is None or max_length is None or not isinstance(dataset, Dataset):
        return
    kept = len(dataset)
    if kept == 0 and expected_rows > 0:
        raise ValueError(
            f"Every example of train_dataset was dropped: each prompt alone has at least max_length={max_length} "
            "tokens, leaving no completion token to train on. Raise max_length in KTOConfig, or shorten the prompts."
        )
    if kept < expected_rows:
        warnings.warn(
            f"{expected_rows - kept} of {expected_rows} training examples were dropped because their prompt alone "
            f"has at least max_length={max_length} tokens. Raise max_length in KTOConfig to keep them.",
            UserWarning,
            stacklevel=3,
        )


def check_context(model, dataset, max_length: int | None) -> None:
    """An error when the longest training sequence (after max_length's truncation) does not fit the context slimrl
    was told to size for (FastLanguageModel's max_seq_length); a warning when it only passes the model's
    max_position_embeddings, which transformers' RoPE runs past as TRL does."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0 or "prompt_ids" not in dataset.column_names:
        return
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    prompt_lengths = pc.list_value_length(table["prompt_ids"])
    longest = max(pc.max(pc.add(prompt_lengths, pc.list_value_length(table[key]))).as_py() or 0
                  for key in ("completion_ids", "KL_completion_ids") if key in dataset.column_names)  # fmt: skip
    longest = longest if max_length is None else min(longest, max_length)
    limit = getattr(getattr(model, "slimrl_options", None), "max_seq_length", None)
    source = "max_seq_length given to FastLanguageModel.from_pretrained"
    if limit is None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        limit, source = getattr(config, "max_position_embeddings", None), "the model's max_position_embeddings"
    if limit is None or longest <= limit:
        return
    message = (f"The longest training sequence has {longest} tokens, beyond the model's context of {limit} tokens "
               f"({source}). Set max_length={limit} in KTOConfig (longer sequences are then cut from the right), or "
               "shorten the examples.")  # fmt: skip
    if getattr(getattr(model, "slimrl_options", None), "max_seq_length", None) is not None:
        raise ValueError(message)
    warnings.warn(message, UserWarning, stacklevel=3)
