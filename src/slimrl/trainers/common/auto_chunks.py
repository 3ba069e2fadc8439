"""`num_chunks="auto"`: how many chunks a micro-batch is split into, from the memory the step may use."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def auto_num_chunks(trainer, lengths: list[int], device: torch.device) -> int:
    """Chunks for sequences of these token lengths. On CPU memory is not the constraint: one piece."""
    if device.type != "cuda":
        return 1
    from slimrl.models.checkpointing import offload_state
    from slimrl.trainers.common.memory import ChunkCosts, choose_num_chunks

    model, trainable = _unwrapped_and_trainable(trainer)
    state = offload_state(model)  # the model's own offloading settings, when it has them
    free_bytes, _ = torch.cuda.mem_get_info(device)
    # gradients the step's first backward will allocate (those already there are outside the free memory)
    gradient_bytes = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
    costs = ChunkCosts(
        model.config,
        dtype=model.dtype,
        offloaded=state is not None,
        mlp_tile_tokens=state.mlp_tile_tokens if state is not None else 0,
        gradient_bytes=gradient_bytes,
        min_offload_bytes=state.min_offload_bytes if state is not None else 0,
    )
    choice = choose_num_chunks(costs, lengths, free_bytes)
    if getattr(trainer, "_last_auto_chunks", None) != choice.num_chunks:
        logger.info("slimrl: num_chunks=auto chose %d (%s)", choice.num_chunks, choice.explanation)
        trainer._last_auto_chunks = choice.num_chunks
    return choice.num_chunks


def _unwrapped_and_trainable(trainer) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """(the unwrapped model, its trainable parameters), found once per `trainer.model`: accelerate's unwrap walks every
    module to look for compiled regions, and listing the parameters walks them again (together milliseconds of host
    time at every step of a LoRA model); the list only sizes the gradients in a memory estimate."""
    cached = getattr(trainer, "_slimrl_auto_chunks_model", None)
    if cached is None or cached[0] is not trainer.model:
        model = trainer.accelerator.unwrap_model(trainer.model)
        cached = trainer._slimrl_auto_chunks_model = (trainer.model, model, [p for p in model.parameters()
                                                                             if p.requires_grad])  # fmt: skip
    return cached[1], cached[2]
