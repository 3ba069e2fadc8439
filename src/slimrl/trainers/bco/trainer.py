"""slimrl's BCO trainer: binary classifier optimisation on unpaired thumbs-up / thumbs-down data (TRL 0.2x's
BCOTrainer, which TRL 1.16 removed), with a chunked training step.

Built on TRL 1.16's KTOTrainer, whose unpaired-data machinery BCO shares exactly (TRL 0.2x's BCO was a fork of its
KTO): tokenisation with chat templates, the EOS, max_length truncation, the collator, the reference model (a copy,
the "ref" adapter, or the adapter disabled), precomputed reference log-probs, the fused LM head, metric logging and
evaluation. BCO differs in what KTO's mismatched ("KL") completions did: it needs none (`calculate_KL` is always
False, so TRL builds none and any sampling order works), its reference point is the running mean of the rewards
(loss.RunningMoments), and its loss is -log sigmoid(+-(r - delta)). Overrides, each for one reason:
- `__init__`: TRL 0.2x's BCOTrainer signature; refuses what slimrl does not support, checks the dataset's columns
  and labels before TRL prepares it, and with `embedding_func` and `embedding_tokenizer` turns on density-ratio
  matching (UDM): its collator then carries each row's `udm_weight` into the batch.
- `_prepare_dataset`: TRL's, then the prompt cut to max_prompt_length and the completion to max_completion_length,
  and only then the examples whose prompt fills max_length dropped, with a warning (data.py); with UDM, the
  density-ratio classifier fit on the train dataset and every dataset given its `udm_weight` column (udm.py).
- `_set_signature_columns_if_needed`: TRL's columns, plus `udm_weight` with UDM, so the Trainer keeps it.
- `compute_loss`: BCO's loss in chunks of sequences through the chunk-plan protocol. Before the first chunk: the
  reference log-probs and, in training, the running shift folded with the micro-batch's rewards (a gradient-free
  policy pass when there are several chunks; with one chunk its own forward supplies them).
- `compute_ref_log_probs`: the precompute pass (`precompute_ref_log_probs`) in the training step's chunks.
- `_save_optimizer_and_scheduler` / `_load_optimizer_and_scheduler`: the running shift saved with each checkpoint
  (`running.json`, as TRL 0.2x) and restored on resume.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass

import torch

from slimrl.trainers.bco import data, udm
from slimrl.trainers.bco.checks import check_datasets, check_udm_arguments, check_unsupported_arguments
from slimrl.trainers.bco.config import BCOConfig
from slimrl.trainers.bco.loss import RunningMoments, append_metrics, bco_losses
from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, plan_by_length
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.slim_fields import with_slim_fields
from slimrl.trainers.common.trl_originals import trl_original
from slimrl.trainers.common.unpaired import chunk_stats, gathered_sums, reference_forward

__all__ = ["BCOConfig", "BCOTrainer"]

# What TRL's text collator puts in a batch (no KL sequences for BCO); the chunked step splits each of these by rows.
BATCH_KEYS = frozenset({"input_ids", "attention_mask", "completion_mask", "label", "ref_logps", udm.WEIGHT_COLUMN})
SEQUENCE_KEYS = ("input_ids", "attention_mask", "completion_mask")  # [N, T]: a chunk keeps its width's columns
STATS = "bco"  # the name of a chunk's metric sums (loss.STAT_NAMES) in run_chunks' totals
RUNNING_NAME = "running.json"  # TRL 0.2x's file for the running shift in a checkpoint


@dataclass(frozen=True)
class _MicroBatch(ChunkPlan):
    """What every chunk's share of the loss depends on; the normaliser is N, TRL's loss being the mean over rows."""

    desirable: torch.Tensor  # [N] bool
    ref_logps: torch.Tensor  # [N] reference completion log-probs
    delta: torch.Tensor | None  # the running shift, detached; None: one training chunk, which folds in its rewards
    weights: torch.Tensor | None  # [N] UDM's per-row loss weights (from the dataset, so fixed per row); None: off


# TRL's KTOTrainer, also when slimrl's KTO is patched into trl before this module is imported
TRLKTOTrainer = trl_original("trl", "KTOTrainer")


class BCOTrainer(SlimTrainerMixin, ChunkedTrainerMixin, TRLKTOTrainer):
    """BCO (arXiv:2404.04656) with TRL 0.2x's interface, its sequences run in chunks. Reference = `ref_model`, else
    the policy's "ref" adapter or the policy with its adapter disabled, else a copy of the initial policy."""

    _tag_names = ["trl", "bco"]
    _name = "BCO"
    _paper = {
        "title": "Binary Classifier Optimization for Large Language Model Alignment",
        "id": "2404.04656",
        "citation": textwrap.dedent("""\
            @article{jung2024binary,
                title  = {{Binary Classifier Optimization for Large Language Model Alignment}},
                author = {Seungjae Jung and Gunsoo Han and Daniel Wontae Nam and Kyoung{-}Woon On},
                year   = 2024,
                eprint = {arXiv:2404.04656},
            }"""),
    }

    def __init__(self, model, ref_model=None, args: BCOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, data_collator=None, model_init=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, peft_config=None, compute_metrics=None, model_adapter_name=None,
                 ref_adapter_name=None, embedding_func=None, embedding_tokenizer=None,
                 quantization_config=None):  # fmt: skip
        check_unsupported_arguments(model_init, preprocess_logits_for_metrics, model_adapter_name, ref_adapter_name)
        check_udm_arguments(embedding_func, embedding_tokenizer)
        if args is not None and not isinstance(args, BCOConfig):
            raise TypeError(f"args must be a slimrl.BCOConfig (BCO's settings live there), got {type(args).__name__}.")
        args = with_slim_fields(args, model, BCOConfig, "BCO")
        check_datasets(train_dataset, eval_dataset)
        self.running = RunningMoments()
        # read by _prepare_dataset, which TRL calls inside its __init__
        self.embedding_func, self.embedding_tokenizer = embedding_func, embedding_tokenizer
        self.clf = None  # the density-ratio classifier (TRL 0.2x's name), fit on the train dataset with UDM
        super().__init__(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
                         compute_metrics, callbacks, optimizers, quantization_config, peft_config)  # fmt: skip
        if self.match_underlying_distribution:
            self.data_collator = udm.WithUDMWeights(self.data_collator)
        if self.aux_loss_enabled:
            raise ValueError("slimrl's BCOTrainer does not add a Mixture-of-Experts load-balancing loss; set "
                             "router_aux_loss_coef=0.0 in BCOConfig to train this MoE model without it.")  # fmt: skip
        self._apply_memory_savers()

    @property
    def match_underlying_distribution(self) -> bool:
        """Whether density-ratio matching (UDM) weights the thumbs-down examples (TRL 0.2x's name)."""
        return self.embedding_func is not None and self.embedding_tokenizer is not None

    # BCO builds no mismatched completions: TRL's KTO machinery reads this flag (set in its __init__) to skip them
    calculate_KL = property(lambda self: False, lambda self, value: None)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # contract: TRL's tokenised dataset (prompt_ids, completion_ids, label), its prompts and completions cut to
        # max_prompt_length and max_completion_length before the examples whose prompt fills max_length are dropped
        with data.without_kto_weight_advice(TRLKTOTrainer.__module__):
            prepared = super()._prepare_dataset(dataset, processing_class, data.WithoutDrop(args), dataset_name)
        prepared = data.truncate(prepared, args, dataset_name)
        data.report_dropped(prepared, dataset, args, dataset_name)
        if not self.match_underlying_distribution:
            return prepared
        embed = udm.PromptEmbedder(self.embedding_func, self.embedding_tokenizer, processing_class,
                                   args.per_device_train_batch_size, args.device)  # fmt: skip
        if self.clf is None:  # TRL prepares the train dataset first, in __init__
            self.clf = udm.fit_classifier(prepared, embed, args)
        return udm.with_weights(prepared, self.clf, embed, args, dataset_name)

    def _set_signature_columns_if_needed(self):
        # contract: TRL's columns kept for the collator, plus the UDM weights the collator wrapper reads
        super()._set_signature_columns_if_needed()
        if self.match_underlying_distribution and udm.WEIGHT_COLUMN not in self._signature_columns:
            self._signature_columns = [*self._signature_columns, udm.WEIGHT_COLUMN]

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: a scalar loss whose backward() completes the gradient (earlier chunks already backpropagated),
        # the metrics appended to self._metrics[mode] once per micro-batch; with return_outputs, the model outputs
        # recomputed without grad, as TRL 1.16 does for compute_metrics
        batch = {k: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        self._one_piece_reason(batch, return_outputs)
        mode = "train" if self.model.training else "eval"
        loss = self._chunked_loss(model, batch, mode, num_items_in_batch).loss
        if not return_outputs:
            return loss
        with torch.no_grad():
            outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        return loss, outputs

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """BCO has no TRL one-piece loss to fall back to: a batch the chunked step cannot split is an error."""
        unknown = sorted(set(inputs) - BATCH_KEYS)
        if unknown:
            raise ValueError(f"The batch carries inputs slimrl's BCOTrainer does not read ({', '.join(unknown)}); a "
                             "custom data_collator must return TRL's unpaired keys: input_ids, attention_mask, "
                             "completion_mask, label (and ref_logps when precomputed).")  # fmt: skip
        if self.match_underlying_distribution and udm.WEIGHT_COLUMN not in inputs:
            raise ValueError(f"Density-ratio matching is on but the batch has no {udm.WEIGHT_COLUMN!r}: the trainer's "
                             "data_collator was replaced after construction. Pass a custom collator to BCOTrainer as "
                             "data_collator=..., which slimrl wraps to carry the weights.")  # fmt: skip
        return None

    def _plan_micro_batch(self, model, batch, mode: str, num_items_in_batch=None) -> _MicroBatch:
        """The chunk plan, the reference log-probs and the running shift, over the whole micro-batch."""
        device = batch["input_ids"].device
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)  # [N]
        lengths = sequence_lengths(batch)
        chunks = plan_by_length(lengths, self._num_chunks_for(lengths.tolist(), device), min_width=2)
        if self.precompute_ref_logps:
            ref_logps = batch["ref_logps"].to(device)
        else:
            with reference_forward(self) as reference:
                ref_logps = self._sequence_logps(reference, batch, chunks)
        delta = None
        if mode != "train":  # evaluation reads the shift without moving it (TRL 0.2x's do_train=False)
            delta = self._delta(device)
        elif len(chunks) > 1:  # the shift needs every row's reward before the first chunk's loss
            with torch.no_grad():
                policy_logps = self._sequence_logps(model, batch, chunks)  # [N]
            delta = self._fold_rewards(self.beta * (policy_logps - ref_logps))
        weights = batch.get(udm.WEIGHT_COLUMN)
        weights = weights.to(device) if weights is not None else None
        return _MicroBatch(chunks, desirable.numel(), desirable, ref_logps, delta, weights)

    def _chunk_loss(self, model, batch, plan: _MicroBatch, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its share of the metric sums."""
        outputs, logps, completion_mask = self._forward(model, batch, chunk)  # logps [b]
        rows = chunk.rows.to(logps.device)
        desirable = plan.desirable.index_select(0, rows)  # [b]
        rewards = self.beta * (logps - plan.ref_logps.index_select(0, rows))  # [b]
        stats = {}
        delta = plan.delta
        if delta is None:  # the only chunk of a training micro-batch: its rewards are the micro-batch's
            delta = stats["delta"] = self._fold_rewards(rewards.detach())
        weights = plan.weights.index_select(0, rows) if plan.weights is not None else None
        loss = bco_losses(rewards, desirable, delta, weights).sum() / plan.normaliser
        positions = chunk.width - 1  # shifted: position j predicts token j + 1
        stats[STATS] = chunk_stats(logps, rewards, desirable, outputs.entropy[:, -positions:],
                                   outputs.mean_logits[:, -positions:], completion_mask[:, 1:])  # fmt: skip
        return loss, stats

    def _fold_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """Fold the micro-batch's rewards [N] (every process's) into the running shift; the new shift."""
        reduce_sum = None
        if self.accelerator.num_processes > 1:
            reduce_sum = lambda t: self.accelerator.reduce(t, reduction="sum")  # noqa: E731
        self.running.update(rewards, reduce_sum)
        return self._delta(rewards.device)

    def _delta(self, device) -> torch.Tensor:
        return torch.tensor(self.running.mean, dtype=torch.float32, device=device)

    def _forward(self, model, batch, chunk: Chunk):
        """The chunk's rows through `model`'s fused LM head: (outputs, completion log-probs [b], completion mask
        [b, width])."""
        rows = chunk.rows.to(batch["input_ids"].device)
        input_ids, attention_mask, completion_mask = (
            batch[name].index_select(0, rows)[:, : chunk.width] for name in SEQUENCE_KEYS
        )
        labels = input_ids.masked_fill(completion_mask == 0, -100)
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, labels=labels,
                        fused_lm_head=True)  # fmt: skip
        # prompt-learning PEFT prepends virtual positions: keep those of the real tokens, as TRL does
        logps = outputs.log_probs[:, -(chunk.width - 1) :].sum(-1)
        return outputs, logps, completion_mask

    def _sequence_logps(self, model, batch, chunks: list[Chunk]) -> torch.Tensor:
        """Completion log-probs [N] of every sequence, chunk by chunk; call under no_grad."""
        logps = None
        for chunk in chunks:
            chunk_logps = self._forward(model, batch, chunk)[1]
            if logps is None:
                logps = chunk_logps.new_zeros(batch["input_ids"].size(0))
            logps.index_copy_(0, chunk.rows.to(logps.device), chunk_logps)
        return logps

    def _log_chunk_metrics(self, mode: str, batch, plan: _MicroBatch, totals: ChunkStats) -> None:
        """BCO's metrics of the micro-batch: every sum gathered across processes in one call."""
        delta = plan.delta if plan.delta is not None else totals["delta"]
        sums = gathered_sums(self, mode, totals[STATS], plan.desirable, batch["attention_mask"])
        append_metrics(self._metrics[mode], float(delta), sums, self._total_train_tokens)

    # -- the precompute pass ---------------------------------------------------------------------------------------

    def compute_ref_log_probs(self, model, inputs):
        # contract: TRL's (reference completion log-probs [B], None) with the same values; `precompute_ref_log_probs`
        # scores its batches in the training step's chunks, so no forward holds more rows than a training chunk
        lengths = sequence_lengths(inputs)
        chunks = plan_by_length(lengths, self._num_chunks_for(lengths.tolist(), inputs["input_ids"].device), 2)
        if len(chunks) <= 1 or set(inputs) - BATCH_KEYS:
            return super().compute_ref_log_probs(model, inputs)
        logps = None
        for chunk in chunks:
            rows = chunk.rows.to(inputs["input_ids"].device)
            part = {key: value.index_select(0, rows) for key, value in inputs.items()}
            part.update({key: part[key][:, : chunk.width] for key in SEQUENCE_KEYS})
            chunk_logps = super().compute_ref_log_probs(model, part)[0]
            if logps is None:
                logps = chunk_logps.new_zeros(lengths.numel())
            logps.index_copy_(0, rows.to(logps.device), chunk_logps)
        return logps, None

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):
        # contract: the Trainer's files, plus the running shift (TRL 0.2x's running.json) from the main process
        super()._save_optimizer_and_scheduler(output_dir)
        if self.accelerator.is_main_process:
            with open(os.path.join(output_dir, RUNNING_NAME), "w") as f:
                json.dump(self.running.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # contract: the Trainer's, plus the running shift where the checkpoint has one
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, RUNNING_NAME) if checkpoint else None
        if path and os.path.isfile(path):
            with open(path) as f:
                self.running = RunningMoments(**json.load(f))


def sequence_lengths(batch) -> torch.Tensor:
    """[N] on the host: each sequence's last attended (or completion) column + 1; the columns after it are right
    padding a chunk can drop."""
    mask = batch["attention_mask"].bool() | batch["completion_mask"].bool()
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return (mask * positions).amax(dim=1).cpu()
