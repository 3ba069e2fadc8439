"""Planning a rollout before any device work: what each request may generate, how prompts are grouped into waves
that fit the memory budget, and the shapes (batch bucket, cache length) that captured graphs are shared by.

The bytes a row of a wave costs are counted here, beside the buffers that hold them (`Session`, `StaticKVCache`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from slimrl.rollout.kv_cache import kv_bytes_per_token
from slimrl.rollout.sampling import SamplingParams

PREFILL_TOKENS = 16384  # prompt tokens per prefill block: bounds the prefill's activation memory
# where a trainer's engine gets its max_seq_len, for the errors that say to raise it
RAISE_LIMIT = "FastLanguageModel.from_pretrained's max_seq_length"
SEQ_ROUND = 128  # cache lengths are rounded up to this, so rollouts of similar length reuse one captured graph


def bucket(batch: int) -> int:
    """Batch sizes share captured graphs by bucket: 1, 2, 4, 8, then multiples of 8."""
    if batch <= 8:
        return 1 << (batch - 1).bit_length()
    return 8 * math.ceil(batch / 8)


def bucket_below(rows: int) -> int:
    """The largest bucket size not above `rows` (>= 1): a wave of that many rows gets a cache of exactly that many."""
    return 8 * (rows // 8) if rows >= 8 else 1 << (rows.bit_length() - 1)


def cache_length(prompt_length: int, longest_limit: int, max_seq_len: int) -> int:
    """Cache columns of a wave: its padded prompt length plus its longest completion, rounded up to SEQ_ROUND (within
    max_seq_len). With left padding a short prompt's completion can reach past max_seq_len columns."""
    longest = prompt_length + longest_limit
    return max(longest, min(max_seq_len, SEQ_ROUND * math.ceil(longest / SEQ_ROUND)))


def shared_prefix(rows: int, distinct: int, prompt_length: int, longest_limit: int, max_seq_len: int) -> tuple | None:
    """The shape of a shared prompt cache (`kv_cache`) for a wave of `rows` rows holding `distinct` prompts, as
    ((prefix rows, prefix columns), columns every row sees), or None when it would not hold fewer columns than the
    plain cache (`cache_length` columns a row). Prefix rows are bucketed like batches and prefix columns rounded up
    to SEQ_ROUND (a multiple of every attention tile), so waves of similar shape share a captured graph."""
    prefix_rows, prefix_len = bucket(distinct), SEQ_ROUND * math.ceil(prompt_length / SEQ_ROUND)
    own = SEQ_ROUND * math.ceil(max(1, longest_limit) / SEQ_ROUND)
    if prefix_rows * prefix_len + rows * own >= rows * cache_length(prompt_length, longest_limit, max_seq_len):
        return None
    return (prefix_rows, prefix_len), prefix_len + own


def request_limits(prompts: list[list[int]], params: SamplingParams, max_new_tokens, vocab_size: int,
                   max_seq_len: int, cap: bool = True) -> list[int]:  # fmt: skip
    """New tokens each prompt may get (max_new_tokens, one int or one per prompt, default params.max_tokens, capped
    so prompt + completion fit max_seq_len), or a ValueError naming the bad request. cap=False: a prompt whose
    completion would be cut by max_seq_len is an error too (a trainer asked for max_new_tokens, and a shorter
    completion would change its run silently)."""
    if not prompts:
        raise ValueError("generate needs at least one prompt.")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token.")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}).")
        if len(p) >= max_seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, leaving no room under max_seq_len={max_seq_len}; "
                             f"truncate prompts or raise max_seq_len ({RAISE_LIMIT}).")  # fmt: skip
    if max_new_tokens is None:
        max_new_tokens = params.max_tokens
    if max_new_tokens is None:
        raise ValueError("Say how many tokens to generate: max_new_tokens=... or SamplingParams(max_tokens=...).")
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    if len(max_new_tokens) != len(prompts):
        raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for {len(prompts)} prompts.")
    if any(m < 0 for m in max_new_tokens):
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if not cap:
        for i, (p, m) in enumerate(zip(prompts, max_new_tokens, strict=True)):
            if len(p) + m > max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens: with max_new_tokens={m} that is {len(p) + m}, past the "
                    f"engine's max_seq_len={max_seq_len}, so its completion would be cut short; truncate prompts to "
                    f"{max_seq_len - m} tokens, lower max_new_tokens (max_completion_length), or raise max_seq_len "
                    f"({RAISE_LIMIT})."
                )
    return [min(int(m), max_seq_len - len(p)) for p, m in zip(prompts, max_new_tokens, strict=True)]


def bytes_per_row(decoder, seq_len: int) -> int:
    """Device bytes one row of a wave holds: its KV cache (`StaticKVCache`), the session's per-token buffers (int64
    output token, fp32 log-prob, additive mask: about 12 bytes a column) and the sampling step's logits and their
    fp32 copies and noise (about 16 bytes a vocabulary entry)."""
    per_token = kv_bytes_per_token(decoder.num_layers, decoder.kv_heads, decoder.head_dim, decoder.dtype) + 12
    return seq_len * per_token + decoder.vocab_size * 16


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(total bytes, bytes this process has allocated) of a CUDA device; None elsewhere: off CUDA no budget applies
    (the CPU's memory is the host's, shared with everything else)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory, torch.cuda.memory_allocated(device)


def rows_within_budget(total_bytes: int, allocated_bytes: int, held_bytes: int, row_bytes: int,
                       gpu_memory_utilization: float) -> int:  # fmt: skip
    """Rows of `row_bytes` each that fit when the process may use gpu_memory_utilization x total_bytes in all. What is
    allocated counts against it, except held_bytes (the engine's current cache, freed before the new one is made).
    0 when not even one fits."""
    budget = gpu_memory_utilization * total_bytes - (allocated_bytes - held_bytes)
    return max(0, int(budget // row_bytes))


def shared_wave_bytes(decoder, rows: int, shared: SharedPlan) -> int | None:
    """The device bytes of a wave of `rows` rows with the shared prompt cache: its distinct prompts (`shared.distinct`,
    the idle rows' [pad] among them) in the prefix, each row its own columns and step buffers. None when the engine
    would keep a copy per row (`shared_prefix`), whose bytes `bytes_per_row` counts."""
    shape = shared_prefix(rows, shared.distinct(rows), shared.prompt_length, shared.longest_limit, shared.max_seq_len)
    if shape is None:
        return None
    (prefix_rows, prefix_len), columns = shape
    per_token = kv_bytes_per_token(decoder.num_layers, decoder.kv_heads, decoder.head_dim, decoder.dtype)
    own = rows * ((columns - prefix_len) * per_token + 12 * columns + decoder.vocab_size * 16)
    return prefix_rows * prefix_len * per_token + own


class DistinctPrompts:
    """How many distinct prompts a wave of its first `rows` rows holds, for the prompts still to come in wave order:
    counted once, as far as asked; rows past the prompts are idle rows, which share one [pad] prompt."""

    def __init__(self, prompts: list):
        self.prompts, self.seen, self.counts = prompts, set(), [0]

    def __call__(self, rows: int) -> int:
        count = min(rows, len(self.prompts))
        while len(self.counts) <= count:
            self.seen.add(tuple(self.prompts[len(self.counts) - 1]))
            self.counts.append(len(self.seen))
        return self.counts[count] + (1 if rows > count else 0)


class SharedPlan(NamedTuple):
    """What `rows_that_fit` needs to count a wave with the shared prompt cache: the wave's longest prompt and
    completion, the distinct prompts of its first rows (`DistinctPrompts`), the engine's limit."""

    prompt_length: int
    longest_limit: int
    distinct: DistinctPrompts
    max_seq_len: int


def rows_that_fit(decoder, seq_len: int, max_batch_size: int, gpu_memory_utilization: float | None,
                  held_bytes: int, shared: SharedPlan | None = None) -> int:  # fmt: skip
    """How many rows of this cache length fit the gpu_memory_utilization budget (`rows_within_budget`), rounded down
    to a bucket (a wave's cache has its bucket's rows, so 5 fitting rows make a wave of 4, not a cache of 8), at most
    max_batch_size; max_batch_size when there is no budget (None, or a device `device_memory` does not measure).
    held_bytes: what the engine holds now that the new wave would free first (its current cache). shared: with the
    shared prompt cache, a wave whose bound `shared_wave_bytes` fits takes that many rows even where copies per row
    would not fit (the engine's cache is never larger than either count)."""
    memory = device_memory(decoder.device) if gpu_memory_utilization is not None else None
    if memory is None:
        return max_batch_size
    total, allocated = memory
    row_bytes = bytes_per_row(decoder, seq_len)
    rows = rows_within_budget(total, allocated, held_bytes, row_bytes, gpu_memory_utilization)
    if shared is not None and rows < max_batch_size:
        budget = gpu_memory_utilization * total - (allocated - held_bytes)
        candidates = sorted({bucket_below(r) for r in range(rows + 1, max_batch_size + 1)}, reverse=True)
        for candidate in (c for c in candidates if c > rows):
            needed = shared_wave_bytes(decoder, candidate, shared)
            if needed is not None and needed <= budget:
                rows = candidate
                break
    if rows < 1:
        in_use = (allocated - held_bytes) / 2**30
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} allows {gpu_memory_utilization * total / 2**30:.2f} GiB "
            f"of this GPU's {total / 2**30:.2f} GiB; with {in_use:.2f} GiB in use already (weights, optimizer state) "
            f"that leaves no room for one sequence of {seq_len} cache columns ({row_bytes / 2**20:.1f} MiB): raise it "
            "(FastLanguageModel.from_pretrained(..., gpu_memory_utilization=...)), or lower max_seq_length / "
            "max_new_tokens."
        )
    return min(bucket_below(rows), max_batch_size)


def waves(order: list[int], prompts, limits: list[int], fit) -> Iterator[list[int]]:
    """Consecutive groups of `order` (prompt indices, longest first unless sampling draws in prompt order) that
    `fit(prompt_length, longest_limit, distinct)` rows each can hold: the longest prompt and the longest limit still
    to come, and the distinct prompts of the next rows (`DistinctPrompts`), so a wave's rows are never more than fit
    its cache."""
    start = 0
    while start < len(order):
        rest = order[start:]
        longest = max(len(prompts[i]) for i in rest), max(limits[i] for i in rest)
        rows = fit(*longest, DistinctPrompts([prompts[i] for i in rest]))
        yield order[start : start + rows]
        start += rows
