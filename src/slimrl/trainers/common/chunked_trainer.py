"""What every trainer with a chunked step shares: the memory savers, the chunk count, the backward of inner chunks,
and one log line per reason a batch falls back to TRL's one-piece loss.

`ChunkedTrainerMixin` sits after `SlimTrainerMixin` in a slimrl trainer's bases and before TRL's class. The trainer
calls `_apply_memory_savers()` at the end of `__init__`; its `compute_loss` hands the batch to
`_loss_in_chunks_or_one_piece`, which asks the trainer's `_one_piece_reason(inputs, return_outputs)` whether TRL's
one-piece loss must run, and else calls `_chunked_loss(model, inputs, mode, return_outputs, num_items_in_batch)`
(the mixin's plan -> chunks -> metrics, or the trainer's own); that plans chunks with `_num_chunks_for(lengths,
device)` and runs them with `_run_chunks(model, chunks, chunk_loss)`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from slimrl.trainers.common.chunked_step import Chunk, ChunkStats, run_chunks

logger = logging.getLogger("slimrl.trainers")


class ChunkedTrainerMixin:
    """Chunk planning and the memory savers, for any HF Trainer subclass whose args carry slimrl's fields."""

    def _apply_memory_savers(self) -> None:
        """LoRA inputs not copied where autocast casts them back (exact; models/lora.py), and offloaded checkpoints
        with the MLP recomputed in tiles (exact; see models/checkpointing.py)."""
        from slimrl.models.lora import skip_input_casts_under_autocast

        model = self.accelerator.unwrap_model(self.model)
        skip_input_casts_under_autocast(model)
        self._offload_checkpoints([model])

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
            enable_offloaded_checkpointing(model, settings.mlp_tile_tokens, weights_in_graph=settings.weights_in_graph)

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

    def _loss_in_chunks_or_one_piece(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """What a chunked trainer's `compute_loss` returns: TRL's one-piece loss where the trainer's
        `_one_piece_reason` names why chunking would not be exact, else the trainer's `_chunked_loss`."""
        reason = self._one_piece_reason(inputs, return_outputs)
        if reason is not None:
            return self._one_piece_loss(reason, model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        return self._chunked_loss(model, inputs, mode, return_outputs, num_items_in_batch)

    def _chunked_loss(self, model, inputs, mode: str, return_outputs: bool, num_items_in_batch):
        """The chunked loss, unless the trainer writes its own: `_plan_micro_batch(model, inputs)` computes, before the
        first chunk, what every chunk depends on (its `chunks` among it); `_chunk_loss(model, inputs, plan, chunk)` is
        one chunk's share of the loss and its stats; `_log_chunk_metrics(mode, inputs, plan, totals)` logs TRL's
        metrics from the chunks' summed stats."""
        plan = self._plan_micro_batch(model, inputs)
        loss, totals = self._run_chunks(
            model, plan.chunks, lambda chunk: self._chunk_loss(model, inputs, plan, chunk), num_items_in_batch
        )
        self._log_chunk_metrics(mode, inputs, plan, totals)
        return loss

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


__all__ = ["ChunkStats", "ChunkedTrainerMixin", "OffloadSettings", "offload_settings"]
