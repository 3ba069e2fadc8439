"""`num_chunks="auto"`: how many chunks a micro-batch is split into, from the memory the step may use."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def auto_num_chunks(trainer, lengths: list[int], device: torch.device) -> int:
    """Chunks for sequences of these token lengths. On CPU memory is not the constraint: one piece."""
    if device.type != "cuda":
        return 1
    from slimrl.models.checkpointing import is_offloaded_checkpointing
    from slimrl.trainers.memory import choose_num_chunks

    model = trainer.accelerator.unwrap_model(trainer.model)
    free_bytes, _ = torch.cuda.mem_get_info(device)
    choice = choose_num_chunks(
        model.config,
        lengths,
        free_bytes=free_bytes,
        dtype=model.dtype,
        offloaded=is_offloaded_checkpointing(model),
        tiled_mlp=is_offloaded_checkpointing(model) and bool(getattr(trainer.args, "mlp_tile_tokens", 0)),
    )
    if getattr(trainer, "_last_auto_chunks", None) != choice.num_chunks:
        logger.info("slimrl: num_chunks=auto chose %d (%s)", choice.num_chunks, choice.explanation)
        trainer._last_auto_chunks = choice.num_chunks
    return choice.num_chunks
