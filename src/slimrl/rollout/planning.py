"""Planning a rollout before any device work: what each request may generate, how prompts are grouped into waves
that fit the memory budget, and the shapes (batch bucket, cache length) that captured graphs are shared by.

The bytes a row of a wave costs are counted here, beside the buffers that hold them (`Session`, `StaticKVCache`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from slimrl.rollout.kv_cache import kv_bytes_per_token
from slimrl.rollout.sampling import SamplingParams

PREFILL_TOKENS = 16384  # prompt tokens per prefill block: bounds the prefill's activation memory
SEQ_ROUND = 128  # cache lengths are rounded up to this, so rollouts of similar length reuse one captured graph


def bucket(batch: int) -> int:
    """Batch sizes share captured graphs by bucket: 1, 2, 4, 8, then multiples of 8."""
    if batch <= 8:
        return 1 << (batch - 1).bit_length()
    return 8 * math.ceil(batch / 8)


def cache_length(prompt_length: int, longest_limit: int, max_seq_len: int) -> int:
    """Cache columns of a wave: its padded prompt length plus its longest completion, rounded up to SEQ_ROUND (within
    max_seq_len). With left padding a short prompt's completion can reach past max_seq_len columns."""
    longest = prompt_length + longest_limit
    return max(longest, min(max_seq_len, SEQ_ROUND * math.ceil(longest / SEQ_ROUND)))


def request_limits(prompts: list[list[int]], params: SamplingParams, max_new_tokens, vocab_size: int,
                   max_seq_len: int, sliding_window: int | None) -> list[int]:  # fmt: skip
    """New tokens each prompt may get (max_new_tokens, one int or one per prompt, default params.max_tokens, capped
    so prompt + completion fit max_seq_len), or a ValueError naming the bad request."""
    if not prompts:
        raise ValueError("generate needs at least one prompt.")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token.")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}).")
        if len(p) >= max_seq_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens, leaving no room under max_seq_len={max_seq_len}; "
                             "truncate prompts or raise max_seq_len.")  # fmt: skip
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
    longest = max(len(p) + m for p, m in zip(prompts, max_new_tokens, strict=True))
    if sliding_window is not None and min(longest, max_seq_len) > sliding_window:
        raise ValueError(
            f"sequences of up to {longest} tokens exceed the model's sliding window ({sliding_window}), which the "
            "engine does not implement; generate with transformers or shorten max_new_tokens."
        )
    return [min(int(m), max_seq_len - len(p)) for p, m in zip(prompts, max_new_tokens, strict=True)]


def bytes_per_row(decoder, seq_len: int) -> int:
    """Device bytes one row of a wave holds: its KV cache (`StaticKVCache`), the session's per-token buffers (int64
    output token, fp32 log-prob, additive mask: about 12 bytes a column) and the sampling step's logits and their
    fp32 copies and noise (about 16 bytes a vocabulary entry)."""
    per_token = kv_bytes_per_token(decoder.num_layers, decoder.kv_heads, decoder.head_dim, decoder.dtype) + 12
    return seq_len * per_token + decoder.vocab_size * 16


def rows_that_fit(decoder, seq_len: int, max_batch_size: int, gpu_memory_utilization: float | None,
                  held_bytes: int) -> int:  # fmt: skip
    """How many rows of this cache length fit the gpu_memory_utilization budget (max_batch_size if none). held_bytes:
    what the engine holds now that the new wave would free first (its current cache)."""
    if gpu_memory_utilization is None or decoder.device.type != "cuda":
        return max_batch_size
    total = torch.cuda.get_device_properties(decoder.device).total_memory
    budget = gpu_memory_utilization * total - (torch.cuda.memory_allocated(decoder.device) - held_bytes)
    rows = int(budget // bytes_per_row(decoder, seq_len))
    if rows < 1:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization} leaves no room for even one sequence of {seq_len} "
            "tokens; raise it, or lower max_seq_len / max_new_tokens."
        )
    return min(rows, max_batch_size)


def waves(order: list[int], prompts, limits: list[int], fit) -> Iterator[list[int]]:
    """Consecutive groups of `order` (prompt indices, longest first) that `fit(seq_len)` rows each can hold."""
    start = 0
    while start < len(order):
        seq_len = len(prompts[order[start]]) + max(limits[i] for i in order[start:])
        rows = fit(seq_len)
        yield order[start : start + rows]
        start += rows
