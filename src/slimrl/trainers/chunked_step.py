"""The shared chunked training step: split a micro-batch into chunks of sequences, forward and backward each.

Only one chunk's activations are alive at a time. Every chunk but the last is backpropagated here; the last chunk's
loss is returned with the others' values added as constants, so the caller's single `backward()` (HF Trainer's
`training_step`) completes the gradient exactly as if the micro-batch had run in one piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Chunk:
    rows: torch.Tensor  # [b] indices of the chunk's sequences in the micro-batch
    width: int  # completion columns the chunk needs: its longest completion (right padding beyond is dropped)


def plan_chunks(completion_mask: torch.Tensor, num_chunks: int) -> list[Chunk]:
    """Split the rows of `completion_mask` [N, T] into at most `num_chunks` chunks of near-equal size.

    Rows are grouped by completion length so that each chunk drops as much right padding as possible; the loss is a
    sum over sequences, so the grouping changes nothing but the summation order.
    """
    num_rows = completion_mask.size(0)
    num_chunks = max(1, min(int(num_chunks), num_rows))
    # last non-padding column + 1 of each row (0 for an empty completion); computed on the host once per micro-batch
    positions = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
    lengths = (completion_mask.bool() * positions).amax(dim=1).cpu() if completion_mask.numel() else torch.zeros(0)
    order = torch.argsort(lengths, stable=True) if num_chunks > 1 else torch.arange(num_rows)
    chunks = []
    for rows in torch.tensor_split(order, num_chunks):
        # At least two columns (when the batch has them): TRL's metrics tell per-sequence tensors ([B, 1]) from
        # per-token ones by shape, so a per-token tensor must never shrink to one column. It also keeps a graph for
        # a chunk of empty completions.
        width = max(int(lengths[rows].max()), min(2, completion_mask.size(1)))
        chunks.append(Chunk(rows=rows.to(completion_mask.device), width=width))
    return chunks


def take(tensor: torch.Tensor | None, chunk: Chunk, full_width: int) -> torch.Tensor | None:
    """The chunk's rows of a per-sequence tensor; per-token tensors ([N, full_width]) are cut to the chunk's width."""
    if tensor is None:
        return None
    rows = tensor.index_select(0, chunk.rows.to(tensor.device))
    if rows.dim() >= 2 and rows.size(1) == full_width and full_width != 1:
        rows = rows[:, : chunk.width]
    return rows


def run_chunks(
    chunks: list[Chunk],
    chunk_loss: Callable[[Chunk], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[], contextlib.AbstractContextManager],
) -> torch.Tensor:
    """Loss of all chunks; when grad is enabled, every chunk but the last is backpropagated on the way.

    `backward` is the accelerator's (it applies the fp16 loss scaler); `no_sync` suppresses the data-parallel
    gradient all-reduce for the inner backward passes, so it runs once, with the caller's final backward.
    """
    if not torch.is_grad_enabled() or len(chunks) == 1:
        losses = [chunk_loss(chunk) for chunk in chunks]
        return losses[0] if len(losses) == 1 else torch.stack(losses).sum()
    done = None  # detached sum of the losses already backpropagated
    for chunk in chunks[:-1]:
        with no_sync():
            loss = chunk_loss(chunk)
            backward(loss)
        done = loss.detach() if done is None else done + loss.detach()
    return chunk_loss(chunks[-1]) + done
