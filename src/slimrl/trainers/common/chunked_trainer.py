"""What every trainer with a chunked step shares: the chunk-plan protocol, the memory savers, the chunk count, the
backward of inner chunks, and one log line per reason a batch falls back to TRL's one-piece loss.

The protocol. A chunked trainer declares four things, one method each, with these signatures:

    _one_piece_reason(inputs, return_outputs) -> str | None     why this batch must run as TRL's one piece
    _plan_micro_batch(model, inputs, mode, num_items_in_batch) -> ChunkPlan
                                                                 how to split it, and what every chunk shares:
                                                                 its normaliser, reference log-probs, weights...
    _chunk_loss(model, inputs, plan, chunk) -> (loss, stats)    one chunk's share of the loss, with grad, and its
                                                                 detached metric parts (summed over the chunks)
    _log_chunk_metrics(mode, inputs, plan, totals) -> dict | None
                                                                 TRL's metrics of the micro-batch from the summed
                                                                 stats: appended to the trainer's store, or returned
                                                                 where TRL's caller stores them (ORPO, CPO)

and `_chunked_loss(model, inputs, mode, num_items_in_batch)` runs them: plan, chunks (every chunk but the last
backpropagated on the way, with HF Trainer's accumulation scaling), metrics; it returns a `ChunkedLoss`. A trainer's
`compute_loss` calls `_loss_in_chunks_or_one_piece`, which asks `_one_piece_reason` first; ORPO and CPO call the same
two at TRL's `get_batch_loss_metrics`, online DPO inside its `training_step` (after generation and ranking), PPO (no
TRL class, no one-piece path) from its `compute_loss`.

Base order: `ChunkedTrainerMixin` sits after `SlimTrainerMixin` in a slimrl trainer's bases and before TRL's class
(its `_one_piece_loss` calls TRL's `compute_loss` through `super()`). The trainer calls `_apply_memory_savers()` at the
end of `__init__`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from slimrl.trainers.common.batches import is_multimodal
from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, chunk_sequences, run_chunks

logger = logging.getLogger("slimrl.trainers")


@dataclass(frozen=True)
class ChunkPlan:
    """What a trainer computes over the whole micro-batch before its first chunk; a trainer's plan subclasses this
    with what its chunks share. The rule that makes the chunks' summed gradient the one-piece one: whatever a chunk's
    loss is divided or weighted by is fixed here, never computed from the chunk itself."""

    chunks: list[Chunk]
    # what every chunk's loss terms are divided by: the micro-batch's count of the loss's units (pairs, sequences,
    # label tokens), or per-sequence weights [N] for a loss normalised sequence by sequence (GRPO's)
    normaliser: torch.Tensor | float


@dataclass
class ChunkedLoss:
    """What `_chunked_loss` returns: the micro-batch's loss (earlier chunks already backpropagated), its plan, the
    chunks' summed stats, and the metrics `_log_chunk_metrics` returned (None where it stored them itself)."""

    loss: torch.Tensor
    plan: ChunkPlan
    totals: ChunkStats
    metrics: dict[str, float] | None


class ChunkedTrainerMixin:
    """The chunk-plan protocol (module docstring) and the memory savers, for any HF Trainer subclass whose args carry
    slimrl's fields."""

    def _apply_memory_savers(self) -> None:
        """LoRA inputs not copied where autocast casts them back (exact; models/lora.py), and offloaded checkpoints
        with the MLP recomputed in tiles (exact; see models/checkpointing.py)."""
        from slimrl.models.lora import skip_input_casts_under_autocast

        model = self.accelerator.unwrap_model(self.model)
        skip_input_casts_under_autocast(model)
        self._offload_checkpoints([model])
        self._fast_lora([model])

    def _fast_lora(self, models: list) -> None:
        """The fused LoRA functions (models/fast_lora.py) where the config asks for them: `fast_lora=True`, or unset
        on CUDA for one process or DDP. FSDP and DeepSpeed gather each weight in hooks around its module's own call,
        which the fused functions bypass (they read lora_A and lora_B without calling them), so unset means off there
        and True is refused."""
        from slimrl.distributed.sharded import zero_stage

        wanted = getattr(self.args, "fast_lora", None)
        sharded = self.accelerator.distributed_type == DistributedType.FSDP or zero_stage(self.accelerator) is not None
        if wanted and sharded:
            raise ValueError("fast_lora=True cannot run under FSDP or DeepSpeed: their per-module weight gathering "
                             "does not see the fused functions' reads. Leave fast_lora unset (off there).")  # fmt: skip
        if wanted is None:
            wanted = not sharded and not self.args.use_cpu and torch.cuda.is_available()
        if not wanted:
            return
        from slimrl.models.fast_lora import describe_fast_lora, enable_fast_lora

        for model in models:
            if enable_fast_lora(model):
                logger.info("slimrl: fast LoRA on (%s)", describe_fast_lora(model))

    def _offload_checkpoints(self, models: list) -> None:
        """Offloaded checkpoints for `models` where the config asks for them: `offload_checkpoints=True` on any device
        (a CPU runs the same path with plain copies), unset on CUDA with gradient_checkpointing; the MLP tiles and the
        way gradients reach the weights as `offload_settings` chooses for the distributed setup."""
        args = self.args
        offload = args.offload_checkpoints
        if offload is None:
            offload = args.gradient_checkpointing and not args.use_cpu and torch.cuda.is_available()
        if not offload:
            return
        from slimrl.models.checkpointing import enable_offloaded_checkpointing

        settings = offload_settings(self.accelerator, args.mlp_tile_tokens)
        if settings.mlp_tile_tokens != args.mlp_tile_tokens:
            logger.warning("slimrl: the MLP is recomputed untiled (mlp_tile_tokens=0): %s", settings.untiled_because)
        for model in models:
            enable_offloaded_checkpointing(model, settings.mlp_tile_tokens, weights_in_graph=settings.weights_in_graph,
                                           attention_tokens=args.keep_attention_tokens,
                                           cuda_graphs=args.layer_cuda_graphs)  # fmt: skip

    @property
    def last_auto_chunks(self) -> int | None:
        """The chunk count num_chunks="auto" chose for the latest micro-batch (None before any, or on CPU)."""
        return getattr(self, "_last_auto_chunks", None)

    def _num_chunks_for(self, lengths: list[int], device: torch.device) -> int:
        """Chunks for a micro-batch whose units (sequences, or pairs) hold these token counts."""
        requested = getattr(self.args, "num_chunks", "auto")
        if requested != "auto":
            return int(requested)
        from slimrl.trainers.common.auto_chunks import auto_num_chunks

        return auto_num_chunks(self, lengths, device)

    # -- the protocol: what each chunked trainer declares -------------------------------------------------------

    def _one_piece_reason(self, inputs, return_outputs: bool) -> str | None:
        """Why this batch must run through TRL's one-piece loss (chunking would not be exact), or None."""
        raise NotImplementedError

    def _plan_micro_batch(self, model, inputs, mode: str, num_items_in_batch) -> ChunkPlan:
        """The chunks of the micro-batch and everything they share, computed before the first one."""
        raise NotImplementedError

    def _chunk_loss(self, model, inputs, plan: ChunkPlan, chunk: Chunk) -> tuple[torch.Tensor, ChunkStats]:
        """One chunk's share of the loss (with grad) and its detached stats, which the chunks sum."""
        raise NotImplementedError

    def _log_chunk_metrics(self, mode: str, inputs, plan: ChunkPlan, totals: ChunkStats) -> dict[str, float] | None:
        """TRL's metrics of the micro-batch from the chunks' summed stats, with TRL's names, order and reductions."""
        raise NotImplementedError

    def _chunk_outputs(self, result: ChunkedLoss):
        """The model outputs `compute_loss(return_outputs=True)` returns, for a trainer that chunks such a batch."""
        raise NotImplementedError(f"{type(self).__name__} runs return_outputs=True in one piece")

    # -- the template ----------------------------------------------------------------------------------------------

    def _loss_in_chunks_or_one_piece(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """What a chunked trainer's `compute_loss` returns: TRL's one-piece loss where `_one_piece_reason` names why
        chunking would not be exact, else the chunked loss (with `_chunk_outputs` when outputs are asked for)."""
        reason = self._one_piece_reason(inputs, return_outputs)
        if reason is not None:
            return self._one_piece_loss(reason, model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        result = self._chunked_loss(model, inputs, mode, num_items_in_batch)
        return (result.loss, self._chunk_outputs(result)) if return_outputs else result.loss

    def _chunked_loss(self, model, inputs, mode: str, num_items_in_batch=None) -> ChunkedLoss:
        """Plan -> every chunk's loss (inner chunks backpropagated) -> metrics."""
        plan = self._plan_micro_batch(model, inputs, mode, num_items_in_batch)
        loss, totals = self._run_chunks(
            model, plan.chunks, lambda chunk: self._chunk_loss(model, inputs, plan, chunk), num_items_in_batch
        )
        return ChunkedLoss(loss, plan, totals, self._log_chunk_metrics(mode, inputs, plan, totals))

    def _one_piece_loss(self, reason: str, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's own `compute_loss` (the class after this mixin in the trainer's bases), `reason` logged once."""
        self._log_fallback(reason)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _log_fallback(self, reason: str) -> None:
        """One warning per reason and trainer: the loss runs through TRL's one-piece path."""
        logged = self.__dict__.setdefault("_fallback_reasons_logged", set())
        if reason not in logged:
            logged.add(reason)
            logger.warning("slimrl: running the loss in one piece (TRL's path) because %s.", reason)

    def _run_chunks(self, model, chunks: list[Chunk], chunk_loss, num_items_in_batch=None):
        """`run_chunks` with this trainer's backward: (the micro-batch's loss, the chunks' stats summed).

        HF Trainer divides the returned loss by the accumulation steps before its backward unless the trainer's loss
        is already scaled for accumulation; inner chunks are backpropagated here with the same division, so every
        chunk's gradient is scaled alike."""
        divisor = self._ga_divisor(num_items_in_batch)

        def backward(loss: torch.Tensor) -> None:
            self._backward_inner_chunk(loss / divisor if divisor != 1 else loss)

        return run_chunks(chunks, chunk_loss, backward, lambda: self.accelerator.no_sync(model))

    def _backward_inner_chunk(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        """The backward of a chunk before the micro-batch's last one: accelerate's, except under DeepSpeed, whose
        accelerate backward also runs the optimizer step. There the engine's own backward runs with the accumulation
        boundary off, so DeepSpeed accumulates the chunk's gradient (ZeRO-2/3 partition it) as it does a micro-batch's;
        the last chunk, backpropagated by the caller through accelerate, ends the micro-batch and steps when the
        accumulation ends. scale_wrt_gas: whether DeepSpeed divides by the accumulation steps, as in the caller's
        final backward (transformers' `training_step` turns that off; TRL's online DPO leaves it on)."""
        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            self.accelerator.backward(loss)
            return
        engine = self.accelerator.deepspeed_engine_wrapped.engine
        engine.set_gradient_accumulation_boundary(is_boundary=False)
        engine.backward(loss, scale_wrt_gas=scale_wrt_gas)

    def _ga_divisor(self, num_items_in_batch) -> int:
        """What HF Trainer's `training_step` divides the returned loss by (its rule, transformers 5.x)."""
        if not torch.is_grad_enabled():
            return 1
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:  # the rule before transformers 5.19 (TRL sets these two attributes to match there)
            scaled = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or (
                getattr(self, "compute_loss_func", None) is not None
            )
        return 1 if scaled else getattr(self, "current_gradient_accumulation_steps", 1)  # set by train()


class ChunkedScoringMixin:
    """Gradient-free scoring passes (old and reference log-probs) of GRPO and RLOO in the training step's chunk size.

    TRL scores a generation batch `batch_size` rows per forward; each such pass is split here as the training step
    splits a micro-batch, sized (with num_chunks="auto") for the longest sequences one pass could hold, so no scoring
    pass holds more activations than a training chunk. Rows are scored independently: same values. Goes before
    `ChunkedTrainerMixin` and TRL's class in the bases."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):  # fmt: skip
        # contract: TRL's (logps [B, T], entropies [B, T] or None, extra) with the same values; only the rows per
        # forward of the gradient-free passes change
        if not torch.is_grad_enabled() and not is_multimodal(kwargs) and input_ids.size(0) > 1:
            batch_size = self._scoring_rows(attention_mask, batch_size or input_ids.size(0))
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kwargs
        )

    def _chunk_logps_and_entropies(self, model, inputs, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs and entropies [b, t] of one chunk's completions (its rows, cut to its width), with grad
        when grad is on (a chunk is already one forward's worth, so no scoring split happens then)."""
        input_ids, attention_mask = chunk_sequences(inputs, chunk)  # [b, P + t]
        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, chunk.width, compute_entropy=True
        )
        return logps, entropies

    def _scoring_rows(self, attention_mask: torch.Tensor, rows_per_pass: int) -> int:
        """Rows per forward of a scoring pass: TRL's `rows_per_pass` split into the training step's chunk count for
        the longest sequences such a pass could hold."""
        longest = sorted(attention_mask.sum(1).tolist(), reverse=True)[:rows_per_pass]
        return max(1, math.ceil(rows_per_pass / self._num_chunks_for(longest, attention_mask.device)))


@dataclass(frozen=True)
class OffloadSettings:
    mlp_tile_tokens: int  # the MLP tile of the recompute (0: untiled)
    weights_in_graph: bool  # the checkpoint returns its weights' gradients (see models/checkpointing.py)
    untiled_because: str | None  # why tiles were turned off, for the log line


def offload_settings(accelerator, requested_tile: int) -> OffloadSettings:
    """How the offloaded checkpoints run under `accelerator`.

    One process and DDP: the weights are inputs of each checkpoint node, so autograd takes one gradient per weight
    per backward from the outer graph, which DDP's reducer needs (tiles included). FSDP and DeepSpeed: their own
    hooks run inside the recompute on the weights they gather, so the recompute accumulates into the weights itself;
    under ZeRO-2/3 a second tile's gradient for the same weight trips DeepSpeed's per-weight bucket check, so the MLP
    is recomputed untiled there."""
    from slimrl.distributed.sharded import zero_stage

    if accelerator.distributed_type == DistributedType.FSDP:
        return OffloadSettings(requested_tile, False, None)
    stage = zero_stage(accelerator)
    if stage is None:
        return OffloadSettings(requested_tile, True, None)
    if stage >= 2 and requested_tile != 0:
        reason = f"DeepSpeed ZeRO-{stage} reduces a weight's gradient once per backward pass, and tiles are " \
                 "backpropagated one at a time."  # fmt: skip
        return OffloadSettings(0, False, reason)
    return OffloadSettings(requested_tile, False, None)


__all__ = [
    "ChunkPlan",
    "ChunkStats",
    "ChunkedLoss",
    "ChunkedScoringMixin",
    "ChunkedTrainerMixin",
    "OffloadSettings",
    "offload_settings",
]
