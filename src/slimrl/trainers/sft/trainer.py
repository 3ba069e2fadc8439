"""slimrl's SFT trainer: TRL's SFTTrainer with a chunked training step and dataset validation.

Overrides, each for one reason (and each keeping TRL's contract, said in a `contract:` line beside it):
- `__init__`: TRL's signature; args become slimrl's SFTConfig (a plain TrainingArguments is converted as TRL converts
  it, into slimrl's class, so the chunk settings survive); after TRL's own checks, an error for pre-tokenized data
  longer than max_length when `skip_prepare_dataset` turns TRL's truncation off; the memory savers.
- `_prepare_dataset`: before TRL's preparation, an error naming the columns SFT needs (TRL raises a bare KeyError from
  inside `Dataset.map`); after it, a warning or an error when truncation left examples with nothing to train on.
- `compute_loss`: runs the micro-batch through TRL's fused LM head in chunks (rows, or whole packed sequences with
  padding-free), only one chunk's activations alive at once, with the loss divided by a normaliser fixed before the
  first chunk so the summed gradient is TRL's; logs TRL's metrics (entropy, mean_token_accuracy, num_tokens) with
  TRL's values from per-chunk sums. Falls back to TRL's one-piece loss, with a logged reason, where chunking would
  not be exact (`_one_piece_reason`).
`SlimTrainerMixin` (trainers/common/base.py) adds the NaN guards and the attention-backend choice around every step.
Everything else (dataset preparation, packing, collation, logging, checkpoints) is TRL's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import trl
from accelerate.utils import is_peft_model
from transformers import TrainingArguments

from slimrl.trainers.common.base import SlimTrainerMixin
from slimrl.trainers.common.batches import is_multimodal, is_padding_free, row_lengths, run_level_obstacle
from slimrl.trainers.common.chunked_step import ChunkStats
from slimrl.trainers.common.chunked_trainer import ChunkedTrainerMixin, ChunkPlan
from slimrl.trainers.common.slim_fields import SlimFields, with_slim_fields
from slimrl.trainers.sft.chunks import (
    packed_chunk_inputs,
    packed_lengths,
    padded_chunk_inputs,
    plan_packed,
    plan_rows,
    unsplit_keys,
)
from slimrl.trainers.sft.inputs import (
    check_not_empty,
    check_preparation_kept_examples,
    check_pretokenized_lengths,
    check_sft_columns,
)

__all__ = ["SFTConfig", "SFTTrainer"]

LOSS_TYPES = ("nll", "dft")
# per-chunk sums the metrics are assembled from
LABEL_TOKENS, ENTROPY_SUM, CORRECT = "label_tokens", "entropy_sum", "correct"


@dataclass
class SFTConfig(SlimFields, trl.SFTConfig):
    """TRL's SFTConfig plus slimrl's settings (the shared ones in SlimFields: num_chunks, offload_checkpoints, ...)."""


def sft_args(args, model) -> SFTConfig:
    """The config slimrl's SFTTrainer runs with. A TrainingArguments that is not an SFT config becomes slimrl's
    SFTConfig with its values (TRL would make it a plain trl.SFTConfig, losing slimrl's fields)."""
    if isinstance(args, TrainingArguments) and not isinstance(args, trl.SFTConfig):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        args = SFTConfig(**values)
    return with_slim_fields(args, model, SFTConfig, "SFT")


@dataclass(frozen=True)
class _Plan(ChunkPlan):
    """A micro-batch cut into chunks: the chunks, the label-token count every chunk's summed loss is divided by (and
    the factor it is then multiplied by), and how to build one chunk's model inputs."""

    scale: int
    inputs_for: Callable[[Any], dict]


class SFTTrainer(SlimTrainerMixin, ChunkedTrainerMixin, trl.SFTTrainer):
    """TRL's SFTTrainer whose training step runs in chunks of sequences. Same constructor, same results."""

    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None, formatting_func=None):  # fmt: skip
        # contract: TRL's arguments, positions and defaults; args=None gets slimrl's SFTConfig named as TRL names it
        args = sft_args(args, model)
        check_not_empty(train_dataset, "train")
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, compute_loss_func,
                         compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics, quantization_config, peft_config, formatting_func)  # fmt: skip
        if self._skip_prepare_dataset and not self._is_vision_dataset:
            datasets = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
            for name, dataset in {"train": self.train_dataset, **datasets}.items():
                check_pretokenized_lengths(dataset, name, self.args.max_length)
        self._apply_memory_savers()

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        # contract: TRL's prepared dataset, unchanged; raises first where TRL's preparation could not use the columns
        check_sft_columns(dataset, dataset_name, args.dataset_text_field, formatting_func is not None)
        prepared = super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        check_preparation_kept_examples(prepared, dataset, dataset_name, args.max_length, packing)
        return prepared

    # -- the chunked loss ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # contract: TRL's loss value, and a scalar whose backward() completes TRL's gradient (earlier chunks already
        # backpropagated with HF Trainer's accumulation scaling); TRL's metrics appended to self._metrics[mode]
        return self._loss_in_chunks_or_one_piece(model, inputs, return_outputs, num_items_in_batch)

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's own one-piece loss, or None when chunking is exact."""
        if return_outputs:
            return "return_outputs=True asks for the full logits, which TRL recomputes in one piece"
        if self.compute_loss_func is not None:
            return "a compute_loss_func needs the model's full logits"
        if self.label_smoother is not None and self.args.loss_type == "nll":
            return "label smoothing needs the model's full logits"
        if self.args.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.args.loss_type!r} is not supported by slimrl ({', '.join(LOSS_TYPES)}).")
        if self.aux_loss_enabled:
            return "the MoE load-balancing loss depends on all tokens of the micro-batch at once"
        if self._is_vision_dataset or is_multimodal(inputs):
            return "vision inputs are not chunked"
        if self.args.use_liger_kernel:
            return "use_liger_kernel is set, and Liger's kernels have not been verified under the chunked step"
        obstacle = run_level_obstacle(self.args, self.accelerator)
        if obstacle is not None:
            return obstacle
        unwrapped = self.accelerator.unwrap_model(self.model)
        if is_peft_model(unwrapped) and getattr(unwrapped.active_peft_config, "is_prompt_learning", False):
            return "prompt-learning PEFT adds virtual tokens that change which labels the LM head scores"
        if inputs.get("labels") is None or inputs.get("input_ids") is None:
            return "the batch lacks input_ids or labels"
        unknown = unsplit_keys(inputs)
        if unknown:
            return f"the batch carries inputs slimrl does not know how to split ({', '.join(unknown)})"
        if is_padding_free(inputs):
            return packed_lengths(inputs)[1]  # a packed row whose sequences cannot be told apart
        return None

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch=None) -> _Plan:
        """The micro-batch's chunks (rows grouped by length, or consecutive whole sequences of the packed row) and the
        normaliser of TRL's loss."""
        device = inputs["input_ids"].device
        normaliser, scale = self._normaliser(inputs, num_items_in_batch)
        if is_padding_free(inputs):
            lengths = packed_lengths(inputs)[0]
            chunks = plan_packed(lengths, self._num_chunks_for(lengths, device))
            return _Plan(chunks, normaliser, scale, lambda chunk: packed_chunk_inputs(inputs, chunk))
        lengths = row_lengths(inputs)
        chunks = plan_rows(lengths, self._num_chunks_for(lengths.tolist(), device), inputs["input_ids"].size(1))
        return _Plan(chunks, normaliser, scale, lambda chunk: padded_chunk_inputs(inputs, chunk))

    def _normaliser(self, inputs, num_items_in_batch) -> tuple[torch.Tensor, int]:
        """(what TRL divides the micro-batch's summed token loss by, what it then multiplies it by), fixed before the
        first chunk: the label tokens the fused head scores (`labels[:, 1:] != -100`), or `num_items_in_batch` when
        the Trainer passes it; the ranks, when that count spans all of them (DDP then averages the gradients)."""
        if num_items_in_batch is None:
            count = (inputs["labels"][:, 1:] != -100).sum()
        else:
            count = num_items_in_batch
        scale = 1
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            scale = self.accelerator.num_processes // self.get_tp_size()
        return torch.as_tensor(count).clamp(min=1), scale

    def _chunk_loss(self, model, inputs, plan: _Plan, chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its label-token, entropy and top-1 counts."""
        # per-token fields [b, t - 1], zero where the label is -100
        outputs = model(**plan.inputs_for(chunk), fused_lm_head=True)
        per_token_loss = -outputs.log_probs
        if self.args.loss_type == "dft":  # DFT: each token's loss weighted by its (constant) probability
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        loss = per_token_loss.sum() / plan.normaliser
        if plan.scale != 1:
            loss = loss * plan.scale
        stats = {
            LABEL_TOKENS: outputs.label_mask.sum(),
            ENTROPY_SUM: outputs.entropy.detach().sum(),
            CORRECT: outputs.is_top1.sum(),
        }
        return loss, stats

    def _log_chunk_metrics(self, mode: str, inputs, plan: _Plan, totals: ChunkStats) -> None:
        """TRL's metrics, names and order, from the chunks' sums gathered as TRL gathers its own."""
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(totals[LABEL_TOKENS]).sum()
        entropy_sum = gather(totals[ENTROPY_SUM]).sum()
        num_correct = gather(totals[CORRECT]).sum()
        metrics = self._metrics[mode]
        metrics["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append((num_correct / num_valid).item() if num_valid > 0 else 0.0)
        if mode == "train":
            if inputs.get("attention_mask") is not None:
                local = inputs["attention_mask"].sum()
            else:  # padding-free: every column of the packed row is a token
                local = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
            self._total_train_tokens += gather(local).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
