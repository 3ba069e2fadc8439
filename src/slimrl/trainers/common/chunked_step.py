"""The shared chunked training step: split a micro-batch into chunks of sequences, forward and backward each.

Only one chunk's activations are alive at a time. Every chunk but the last is backpropagated here; the last chunk's
loss is returned with the others' values added as constants, so the caller's single `backward()` (HF Trainer's
`training_step`) completes the gradient exactly as if the micro-batch had run in one piece.

The API, for any trainer whose loss is a sum of per-sequence (or per-group) terms:

    chunks = plan_chunks(completion_mask, num_chunks)            # [Chunk(rows, width), ...]
    loss, totals = run_chunks(chunks, chunk_loss, backward, no_sync)

`chunk_loss(chunk) -> (loss, stats)` computes one chunk's share of the loss (with grad) and a dict of detached
tensors (loss sums, token counts, metric numerators and denominators); `run_chunks` returns the micro-batch's loss and,
per name, the sum over chunks of those tensors. Per-sequence values (for a min or max over sequences) go in with
`chunk.spread(values, num_rows)`: each row belongs to one chunk, so the sum assembles the micro-batch's vector.
`chunk_loss` keeps no state between calls; whatever the chunks share is computed before the first one.

The rule that makes the summed gradient exact: every quantity a chunk's loss is divided or weighted by is computed
over the whole micro-batch before the first chunk (GRPO's sequence weights, `grpo_loss.sequence_weights`), never
from the chunk itself. How other trainers would plug in:

- SFT: per-token negative log-likelihood; the normaliser is the micro-batch's label-token count (TRL's
  `num_items_in_batch`), known up front. `chunk_loss` returns `(nll_sum / tokens, {"nll": nll_sum.detach(),
  "tokens": count})`, and the logged mean is `totals["nll"] / totals["tokens"]`.
- DPO: the loss of a pair, -logsigmoid(beta * (chosen margin - rejected margin)), is not a sum over its two
  sequences, so a pair must never be split: plan the chunks over pairs (one row per pair, its length the longer of
  the two; `Chunk.rows` are then pair indices and `chunk_loss` forwards both sequences of each pair), and divide by
  the micro-batch's number of pairs, not the chunk's. Reference log-probs come from a gradient-free pass in the same
  chunks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

ChunkStats = dict[str, torch.Tensor]  # name -> detached tensor, summed over chunks by run_chunks


@dataclass(frozen=True)
class Chunk:
    rows: torch.Tensor  # [b] indices of the chunk's sequences in the micro-batch
    width: int  # completion columns the chunk needs: its longest completion (right padding beyond is dropped)

    def spread(self, values: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Per-sequence `values` [b] placed at the chunk's rows of a zero vector [num_rows]: summed over the chunks,
        these give the micro-batch's per-sequence vector (a NaN stays a NaN)."""
        full = torch.zeros(num_rows, dtype=values.dtype, device=values.device)
        return full.index_copy(0, self.rows.to(values.device), values)


def plan_chunks(completion_mask: torch.Tensor, num_chunks: int) -> list[Chunk]:
    """Split the rows of `completion_mask` [N, T] into at most `num_chunks` chunks of near-equal size.

    Rows are grouped by completion length so that each chunk drops as much right padding as possible; the loss is a
    sum over sequences, so the grouping changes nothing but the summation order.
    """
    # last non-padding column + 1 of each row (0 for an empty completion); computed on the host once per micro-batch
    positions = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
    lengths = (completion_mask.bool() * positions).amax(dim=1).cpu() if completion_mask.numel() else torch.zeros(0)
    # At least two columns (when the batch has them): TRL's metrics tell per-sequence tensors ([B, 1]) from
    # per-token ones by shape, so a per-token tensor must never shrink to one column. It also keeps a graph for
    # a chunk of empty completions.
    chunks = plan_by_length(lengths, num_chunks, min_width=min(2, completion_mask.size(1)))
    return [Chunk(rows=chunk.rows.to(completion_mask.device), width=chunk.width) for chunk in chunks]


def plan_by_length(lengths: torch.Tensor, num_chunks: int, min_width: int = 1) -> list[Chunk]:
    """Split units (sequences, or pairs of them) of these lengths [N] into at most `num_chunks` chunks of near-equal
    size, grouped by length so each chunk drops as much right padding as possible. Each chunk's width is its longest
    unit (at least `min_width`). Rows are host tensors."""
    lengths = lengths.detach().to("cpu", torch.long)
    num_rows = lengths.numel()
    num_chunks = max(1, min(int(num_chunks), num_rows))
    order = torch.argsort(lengths, stable=True) if num_chunks > 1 else torch.arange(num_rows)
    return [Chunk(rows=rows, width=max(int(lengths[rows].max()), min_width))
            for rows in torch.tensor_split(order, num_chunks)]  # fmt: skip


def take(tensor: torch.Tensor | None, chunk: Chunk, full_width: int) -> torch.Tensor | None:
    """The chunk's rows of a per-sequence tensor; per-token tensors ([N, full_width]) are cut to the chunk's width."""
    if tensor is None:
        return None
    rows = tensor.index_select(0, chunk.rows.to(tensor.device))
    if rows.dim() >= 2 and rows.size(1) == full_width and full_width != 1:
        rows = rows[:, : chunk.width]
    return rows


def chunk_sequences(inputs: dict, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) [b, P + width] of a chunk's rows of a prompt/completion batch (TRL's
    prompt_ids/prompt_mask and completion_ids/completion_mask): the prompts whole, the completions cut to the chunk's
    width."""
    width = inputs["completion_ids"].size(1)
    ids = torch.cat([take(inputs["prompt_ids"], chunk, -1), take(inputs["completion_ids"], chunk, width)], 1)
    attention = torch.cat([take(inputs["prompt_mask"], chunk, -1), take(inputs["completion_mask"], chunk, width)], 1)
    return ids, attention


def add_stats(totals: ChunkStats, stats: ChunkStats) -> ChunkStats:
    """`totals` with `stats` added name by name (a new name starts at its first value); the first chunk's names keep
    their order."""
    merged = dict(totals)
    for name, value in stats.items():
        merged[name] = value if name not in merged else merged[name] + value
    return merged


def run_chunks(
    chunks: list[Chunk],
    chunk_loss: Callable[[Chunk], tuple[torch.Tensor, ChunkStats]],
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[], contextlib.AbstractContextManager],
) -> tuple[torch.Tensor, ChunkStats]:
    """(loss of all chunks, the chunks' stats summed); when grad is enabled, every chunk but the last is
    backpropagated on the way.

    `backward` is the accelerator's (it applies the fp16 loss scaler); `no_sync` suppresses the data-parallel
    gradient all-reduce for the inner backward passes, so it runs once, with the caller's final backward.
    """
    totals: ChunkStats = {}
    if not torch.is_grad_enabled() or len(chunks) == 1:
        losses = []
        for chunk in chunks:
            loss, stats = chunk_loss(chunk)
            losses.append(loss)
            totals = add_stats(totals, stats)
        return (losses[0] if len(losses) == 1 else torch.stack(losses).sum()), totals
    done = None  # detached sum of the losses already backpropagated
    for chunk in chunks[:-1]:
        with no_sync():
            loss, stats = chunk_loss(chunk)
            backward(loss)
        done = loss.detach() if done is None else done + loss.detach()
        totals = add_stats(totals, stats)
    loss, stats = chunk_loss(chunks[-1])
    return loss + done, add_stats(totals, stats)
