"""How an SFT micro-batch is cut into chunks, and the model inputs of one chunk.

Two layouts come out of TRL's `DataCollatorForLanguageModeling`:
- padded: rows [N, T] right-padded, with an `attention_mask`. A chunk is a set of rows cut to their longest row
  (`plan_by_length` on each row's last attended column), so the chunk drops the right padding the others need.
- padding-free: ONE packed row [1, L] of whole sequences, each starting at position id 0, with the varlen-kernel
  boundaries (`cu_seq_lens_*`, `max_length_*`, `seq_idx`). A chunk is a run of consecutive whole sequences, cut at
  sequence boundaries so that its token counts are near-equal; its boundaries are recomputed for the chunk.

Either way every next-token pair the fused LM head scores lies inside one chunk: a row's first label is never scored,
and a packed sequence's first label is -100 (TRL's collator masks it), so a chunk boundary drops no scored label.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from slimrl.trainers.common.chunked_step import Chunk, plan_by_length, take

PADDED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")  # per-row tensors [N, T]
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")  # padding-free only
FORWARD_FLAGS = ("use_cache",)  # passed to every chunk unchanged
MODEL_INPUT_KEYS = PADDED_KEYS + PACKED_KEYS + FORWARD_FLAGS


def unsplit_keys(inputs: dict) -> list[str]:
    """Inputs (not None) that slimrl does not know how to split by rows or sequences."""
    return sorted(key for key, value in inputs.items() if key not in MODEL_INPUT_KEYS and value is not None)


# -- padded rows ---------------------------------------------------------------------------------------------------


def plan_rows(lengths: torch.Tensor, num_chunks: int, width: int) -> list[Chunk]:
    """Rows grouped by length. At least two columns per chunk (when the batch has them): the fused head scores
    columns 1.., so a one-column chunk would score nothing and the row would still need its graph."""
    return plan_by_length(lengths, num_chunks, min_width=min(2, width))


def padded_chunk_inputs(inputs: dict, chunk: Chunk) -> dict:
    """The chunk's rows, per-row tensors cut to the chunk's width."""
    width = inputs["input_ids"].size(1)
    chunk_inputs = {key: take(inputs[key], chunk, width) for key in PADDED_KEYS if inputs.get(key) is not None}
    chunk_inputs.update({key: inputs[key] for key in FORWARD_FLAGS if key in inputs})
    return chunk_inputs


# -- one packed row ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedChunk:
    start: int  # first column of the chunk in the packed row
    end: int  # one past its last column
    lengths: tuple[int, ...]  # its sequences' token counts, in order


def packed_lengths(inputs: dict) -> tuple[list[int] | None, str | None]:
    """(token count of each packed sequence, None), or (None, why the row cannot be cut at its boundaries)."""
    position_ids = inputs["position_ids"]  # [1, L]
    if position_ids.size(0) != 1:
        return None, f"a padding-free batch has {position_ids.size(0)} rows instead of one packed row"
    width = position_ids.size(1)
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()  # one host sync per micro-batch
    if not starts or starts[0] != 0:
        return None, "the packed row does not start a sequence (position id 0) at its first column"
    bounds = [*starts, width]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        given = inputs.get(key)
        if given is not None and given.tolist() != bounds:
            return None, f"{key} does not match the sequence starts given by position_ids"
    return [end - start for start, end in itertools.pairwise(bounds)], None


def plan_packed(lengths: list[int], num_chunks: int) -> list[PackedChunk]:
    """Consecutive whole sequences in at most `num_chunks` chunks whose token counts are near-equal."""
    count = max(1, min(int(num_chunks), len(lengths)))
    ends = list(itertools.accumulate(lengths))  # column after each sequence
    last_of_chunk, previous = [], -1
    for k in range(1, count):
        target = ends[-1] * k / count
        # the sequence ending nearest the target, leaving at least one sequence for each later chunk
        candidates = range(previous + 1, len(lengths) - (count - k))
        previous = min(candidates, key=lambda i: abs(ends[i] - target))
        last_of_chunk.append(previous)
    last_of_chunk.append(len(lengths) - 1)
    chunks, first = [], 0
    for last in last_of_chunk:
        start = ends[first - 1] if first > 0 else 0
        chunks.append(PackedChunk(start=start, end=ends[last], lengths=tuple(lengths[first : last + 1])))
        first = last + 1
    return chunks


def packed_chunk_inputs(inputs: dict, chunk: PackedChunk) -> dict:
    """The chunk's columns of the packed row, with its own varlen boundaries (what TRL's collator would have built
    had the batch held only these sequences)."""
    columns = slice(chunk.start, chunk.end)
    chunk_inputs = {key: inputs[key][:, columns] for key in ("input_ids", "labels", "position_ids")}
    device = inputs["input_ids"].device
    lengths = torch.tensor(chunk.lengths, dtype=torch.int32, device=device)  # [s]
    bounds = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])  # [s + 1]
    for suffix in ("q", "k"):  # only those the batch has: each kernel reads the ones it was given
        if inputs.get(f"cu_seq_lens_{suffix}") is not None:
            chunk_inputs[f"cu_seq_lens_{suffix}"] = bounds
        if inputs.get(f"max_length_{suffix}") is not None:
            chunk_inputs[f"max_length_{suffix}"] = max(chunk.lengths)
    if inputs.get("seq_idx") is not None:
        index = torch.arange(len(chunk.lengths), dtype=torch.int32, device=device)
        chunk_inputs["seq_idx"] = torch.repeat_interleave(index, lengths)[None]  # [1, l]
    chunk_inputs.update({key: inputs[key] for key in FORWARD_FLAGS if key in inputs})
    return chunk_inputs
