"""slimrl's DPO trainer: TRL's DPOTrainer with a chunked training step and input validation.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; refuses options TRL accepts and then fails on at the first step (use_weighting with
  loss_type 'sft'), checks the datasets' columns and formats before TRL tokenizes them (TRL would fail there with a
  KeyError or TypeError), and after TRL's setup that the tokenized sequences fit the model's context.
- `compute_loss`: runs the micro-batch in chunks of preference pairs (a pair is never split; only one chunk's
  activations are alive at once), each chunk cut to its own width, with every normaliser taken over the whole
  micro-batch so that the summed gradient equals TRL's; logs TRL's metrics with TRL's names and values. What cannot
  be chunked exactly (aot losses, the MoE aux loss, vision inputs, return_outputs=True) runs through TRL's code.
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step;
`ChunkedTrainerMixin` the memory savers, the chunk count and the backward of inner chunks. Everything else
(tokenization, reference log-prob precomputation, evaluation, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import trl
from accelerate.utils import is_peft_model
from trl.trainer.utils import use_adapter

from slimrl.models.checkpointing import gradient_free_forward
from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import is_multimodal
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.preference_inputs import check_preference_dataset, check_sequence_lengths
from slimrl.trainers.common.slim_fields import SlimFields, with_slim_fields
from slimrl.trainers.dpo.loss import (
    BATCH_SORTED_LOSSES,
    CHUNKABLE_LOSSES,
    PairTerms,
    PreferenceLossSettings,
    chunk_loss,
    sequence_logps,
    wpo_weights,
)

__all__ = ["DPOConfig", "DPOTrainer"]

# Inputs of TRL's preference collator that are not model arguments.
NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
PAIR_VECTORS = ("chosen_logps", "rejected_logps", "chosen_logratios", "rejected_logratios")  # [B] stats, spread


@dataclass
class DPOConfig(SlimFields, trl.DPOConfig):
    """TRL's DPOConfig with slimrl's fields (num_chunks, offload_checkpoints, mlp_tile_tokens, on_nonfinite); a
    chunk of DPO holds whole preference pairs."""


@dataclass(frozen=True)
class _PairBatch(ChunkPlan):
    """What every chunk's share of the loss depends on, computed over the whole micro-batch before the first chunk.
    Chunk rows are pair indices (a chunk's width: the columns its pairs need); the normaliser is the pair count B, the
    per-pair mean's divisor."""

    chosen_token_count: torch.Tensor  # label tokens of all chosen completions: the "sft" term's divisor
    settings: PreferenceLossSettings

    @property
    def num_pairs(self) -> int:
        return self.normaliser


class DPOTrainer(SlimTrainerMixin, ChunkedTrainerMixin, trl.DPOTrainer):
    """TRL's DPOTrainer whose training step runs in chunks of preference pairs. Same constructor, same results."""

    def __init__(self, model, ref_model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's DPOConfig named as TRL names it;
        # TRL's own errors (a missing or mistyped train_dataset, ...) keep their text
        args = with_slim_fields(args, model, DPOConfig, "DPO")
        _check_loss_options(args)
        _check_datasets(train_dataset, eval_dataset)
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, quantization_config, peft_config)  # fmt: skip
        if not self._is_vision_dataset:
            unwrapped = self.accelerator.unwrap_model(self.model)
            for name, dataset in _named_datasets(self.train_dataset, self.eval_dataset):
                check_sequence_lengths(unwrapped, dataset, name, self.args.max_length)
        self._apply_memory_savers()

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: a scalar loss whose backward() completes TRL's gradient (earlier chunks already backpropagated),
        # TRL's metrics appended to self._metrics[mode] once per micro-batch, eval mode under no_grad unchanged,
        # (loss, outputs) from TRL's own path when return_outputs=True
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, num_items_in_batch)

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's one-piece loss, or None when it can be chunked exactly."""
        if return_outputs:
            return "return_outputs=True (prediction_loss_only=False or compute_metrics) asks for the batch's logits"
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss depends on all tokens of the micro-batch at once"
        if self._is_vision_dataset or is_multimodal(inputs):
            return "vision inputs are not chunked yet"
        sorted_types = [t for t in self.loss_types if t in BATCH_SORTED_LOSSES]
        if sorted_types:
            return f"loss_type {sorted_types[0]!r} sorts log-ratios across the whole micro-batch"
        unknown = [t for t in self.loss_types if t not in CHUNKABLE_LOSSES]
        if unknown:
            return f"loss_type {unknown[0]!r} is not one slimrl knows how to chunk"
        return _layout_problem(inputs)

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> _PairBatch:
        """The chunk plan over pairs and the micro-batch-wide normalisers."""
        ids, completion_mask = inputs["input_ids"], inputs["completion_mask"]
        num_pairs, width = ids.size(0) // 2, ids.size(1)
        # last used column + 1 of each row: right padding after it is dropped; a left-padded row ends at the last
        # column, so it keeps the full width
        used = inputs["attention_mask"].bool() | completion_mask.bool()  # [2B, T]
        ends = (used * torch.arange(1, width + 1, device=ids.device)).amax(dim=1).cpu()  # [2B]
        pair_widths = torch.maximum(ends[:num_pairs], ends[num_pairs:])  # [B]
        # a pair's two sequences each take the pair's width in its chunk
        count = self._num_chunks_for((2 * pair_widths).tolist(), ids.device)
        return _PairBatch(
            chunks=plan_by_length(pair_widths, count, min_width=min(2, width)),
            normaliser=num_pairs,
            chosen_token_count=completion_mask[:num_pairs, 1:].sum(),
            settings=PreferenceLossSettings.from_trainer(self),
        )

    def _chunk_loss(self, model, inputs, batch: _PairBatch, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its detached metric parts."""
        kwargs, completion_mask = _chunk_inputs(inputs, chunk, batch.num_pairs)  # [2b, w] each
        mask = completion_mask[:, 1:]  # [2b, t] label mask (the fused head scores token j+1 from column j)
        labels = kwargs["input_ids"].masked_fill(completion_mask == 0, -100)
        # alive until this chunk's backward: its activations (2b rows x w columns) and the fused head's per-token fp32
        # outputs [2b, t] (log_probs, entropy, mean_logits, is_top1, with WPO log_sum_sq_probs), never [tokens, vocab]
        outputs = model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True)
        per_token_logps = outputs.log_probs[:, -mask.size(1) :]  # [2b, t]; prompt-tuning PEFT puts virtual tokens first
        logps = sequence_logps(per_token_logps, mask, self.ld_alpha)  # [2b]
        ref_logps = self._chunk_ref_logps(inputs, kwargs, labels, mask, chunk)  # [2b]
        logratios = logps - ref_logps
        chosen_ratio, rejected_ratio = logratios.chunk(2)
        tokens = completion_mask.sum(dim=1)  # [2b] TRL's ipo / sigmoid_norm count the unshifted mask
        terms = PairTerms(chosen_ratio, rejected_ratio, *tokens.chunk(2))
        pair_weights = None
        if self.use_weighting:
            pair_weights = wpo_weights(per_token_logps, outputs.log_sum_sq_probs[:, -mask.size(1) :], mask)
        num_chunk_pairs = chunk.rows.numel()
        chosen_logp_sum = (per_token_logps[:num_chunk_pairs] * mask[:num_chunk_pairs]).sum()
        loss = chunk_loss(batch.settings, terms, batch.num_pairs, pair_weights, chosen_logp_sum,
                          batch.chosen_token_count)  # fmt: skip
        return loss, _chunk_stats(outputs, mask, chunk, batch.num_pairs, logps.detach(), logratios.detach())

    def _chunk_ref_logps(self, inputs, kwargs, labels, mask, chunk: Chunk) -> torch.Tensor:
        """The reference model's sequence log-probs [2b] of the chunk: precomputed, or a gradient-free forward of the
        policy with its adapter disabled (or switched to the "ref" copy), or of `ref_model`."""
        if self.precompute_ref_logps:
            pairs = chunk.rows.to(inputs["ref_chosen_logps"].device)
            return torch.cat([inputs["ref_chosen_logps"][pairs], inputs["ref_rejected_logps"][pairs]])
        with torch.no_grad(), gradient_free_forward(self.model, self.args.gradient_checkpointing_kwargs):
            if is_peft_model(self.model) and self.ref_model is None:
                unwrapped = self.accelerator.unwrap_model(self.model)
                with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                    outputs = self.model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True)
            else:
                outputs = self.ref_model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True)
        return sequence_logps(outputs.log_probs[:, -mask.size(1) :], mask, self.ld_alpha)

    def _log_chunk_metrics(self, mode: str, inputs, batch: _PairBatch, totals: ChunkStats) -> None:
        """Append the micro-batch's metrics in TRL's order, gathered across processes with TRL's reductions."""
        metrics = self._metrics[mode]
        gather = self.accelerator.gather

        def gathered_sum(value: torch.Tensor) -> torch.Tensor:
            return self.accelerator.gather_for_metrics(value).sum()

        entropy_sum, tokens = gathered_sum(totals["entropy_sum"]), gathered_sum(totals["tokens"])
        metrics["entropy"].append((entropy_sum / tokens).item() if tokens > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += gathered_sum(inputs["attention_mask"].sum()).item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        for side in ("chosen", "rejected"):
            logits, count = gathered_sum(totals[f"logits/{side}"]).item(), gathered_sum(totals[f"{side}_tokens"]).item()
            metrics[f"logits/{side}"].append(logits / count if count > 0 else 0.0)
        correct, count = gathered_sum(totals["chosen_top1"]), gathered_sum(totals["chosen_tokens"])
        metrics["mean_token_accuracy"].append((correct / count).item() if count > 0 else 0.0)
        chosen_rewards = self.beta * totals["chosen_logratios"]  # [B]
        rejected_rewards = self.beta * totals["rejected_logratios"]
        metrics["rewards/chosen"].append(gather(chosen_rewards).mean().item())
        metrics["rewards/rejected"].append(gather(rejected_rewards).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen_rewards > rejected_rewards).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen_rewards - rejected_rewards).mean().item())
        metrics["logps/chosen"].append(gather(totals["chosen_logps"]).mean().item())
        metrics["logps/rejected"].append(gather(totals["rejected_logps"]).mean().item())


def _check_loss_options(args) -> None:
    """Options TRL accepts at construction but fails on at the first step (TRL's own option errors come first)."""
    loss_types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
    if args.use_weighting and "sft" in loss_types and not set(loss_types) & set(BATCH_SORTED_LOSSES):
        raise ValueError(
            "use_weighting=True cannot be combined with loss_type 'sft': TRL 1.16 scales the SFT term by the WPO "
            "weights in place on an expanded tensor and fails at the first step. Drop 'sft' from loss_type, or set "
            "use_weighting=False."
        )


def _named_datasets(train_dataset, eval_dataset) -> list[tuple[str, object]]:
    """(name for messages, dataset) of every split the trainer was given that TRL accepts by type."""
    from datasets import Dataset, IterableDataset

    named = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict):
        named += [(f"eval_dataset[{key!r}]", dataset) for key, dataset in eval_dataset.items()]
    else:
        named.append(("eval_dataset", eval_dataset))
    return [(name, dataset) for name, dataset in named if isinstance(dataset, (Dataset, IterableDataset))]


def _check_datasets(train_dataset, eval_dataset) -> None:
    """The column and format checks, for datasets TRL accepts by type (TRL's own type errors keep their text)."""
    for name, dataset in _named_datasets(train_dataset, eval_dataset):
        check_preference_dataset(dataset, name)


def _layout_problem(inputs) -> str | None:
    """Why the batch is not TRL's [chosen; rejected] rows of per-token tensors, or None when it is."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.size(0) % 2:
        return "the batch's input_ids are not [chosen; rejected] rows"
    if "attention_mask" not in inputs or "completion_mask" not in inputs:
        return "the batch has no attention_mask or completion_mask"
    for key, value in inputs.items():
        if key in ("ref_chosen_logps", "ref_rejected_logps"):
            continue
        if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.size(0) != ids.size(0):
            return f"the batch's {key!r} is not one tensor row per sequence"
    return None


def _chunk_inputs(inputs, chunk: Chunk, num_pairs: int) -> tuple[dict, torch.Tensor]:
    """The chunk's model inputs and completion mask: both sequences of its pairs (chosen rows first, as TRL lays them
    out), per-token tensors cut to the chunk's width."""
    ids = inputs["input_ids"]
    pairs = chunk.rows.to(ids.device)
    rows = torch.cat([pairs, pairs + num_pairs])  # [2b]
    width = ids.size(1)

    def take(value: torch.Tensor) -> torch.Tensor:
        value = value.index_select(0, rows.to(value.device))
        return value[:, : chunk.width] if value.dim() >= 2 and value.size(1) == width else value

    kwargs = {key: take(value) for key, value in inputs.items() if key not in NON_MODEL_KEYS}
    return kwargs, take(inputs["completion_mask"])


def _chunk_stats(outputs, mask, chunk: Chunk, num_pairs: int, logps, logratios) -> ChunkStats:
    """The chunk's detached metric parts: token sums, and per-pair vectors placed at the chunk's pairs."""
    num_chunk_pairs = chunk.rows.numel()
    width = mask.size(1)
    entropy = outputs.entropy[:, -width:].detach()  # [2b, t]
    mean_logits = outputs.mean_logits[:, -width:].detach()
    chosen_mask, rejected_mask = mask[:num_chunk_pairs].bool(), mask[num_chunk_pairs:].bool()
    stats = {
        "entropy_sum": (entropy * mask).sum(),
        "tokens": mask.sum(),
        "logits/chosen": mean_logits[:num_chunk_pairs][chosen_mask].sum(),
        "chosen_tokens": chosen_mask.sum(),
        "logits/rejected": mean_logits[num_chunk_pairs:][rejected_mask].sum(),
        "rejected_tokens": rejected_mask.sum(),
        "chosen_top1": (outputs.is_top1[:, -width:][:num_chunk_pairs] & chosen_mask).sum(),
    }
    chosen_logps, rejected_logps = logps.chunk(2)
    chosen_ratio, rejected_ratio = logratios.chunk(2)
    for name, values in zip(PAIR_VECTORS, (chosen_logps, rejected_logps, chosen_ratio, rejected_ratio), strict=True):
        stats[name] = chunk.spread(values, num_pairs)  # [B], zero off the chunk's pairs
    return stats
