"""The per-token memory model of the chunked step, and `num_chunks="auto"`.

What one chunk keeps on the GPU while it is forwarded and backpropagated, per token of the chunk (bytes; d = hidden
size, kv = key/value width, m = MLP width, b = bytes per activation element, L = decoder layers):

- layer checkpoints: L * d * b with ordinary checkpointing; with offloading only the layer being recomputed and the
  one being prefetched stay: 2 * d * b;
- one layer's recompute, attention: q, attention output, o_proj output, residual and norm outputs (about 6 * d) and
  k, v before and after the KV-head repeat (4 * kv), times b, plus as much again for their gradients in backward;
- one layer's recompute, MLP: gate, up, activation and product (4 * m * b) and the same again for their gradients,
  unless the MLP is tiled, when it is bounded by the tile and not by the chunk;
- the fused LM head: the final hidden states it saves (d * b) and fp32 log-prob/entropy per token (8 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HEADROOM = 0.85  # share of the free memory a chunk may plan to use: the allocator fragments, kernels need workspace
# Memory is a budget, not whatever is free: a chunk holds about this many tokens (unless one sequence is longer).
# At 16k tokens every GEMM of a 1B-class model is large enough to keep the GPU busy, so smaller chunks cost no speed.
TARGET_CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class ChunkChoice:
    num_chunks: int
    bytes_per_token: int
    budget_bytes: int
    explanation: str


def bytes_per_token(config, dtype: torch.dtype, offloaded: bool = True, tiled_mlp: bool = True) -> int:
    """Peak GPU bytes one token of a chunk costs during its forward and backward (see the module docstring)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d, m, layers = text.hidden_size, text.intermediate_size, text.num_hidden_layers
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", heads) * (getattr(text, "head_dim", None) or d // heads)
    b = torch.tensor([], dtype=dtype).element_size()
    checkpoints = (2 if offloaded else layers) * d * b
    attention = 2 * (6 * d + 4 * kv) * b  # activations and their gradients
    mlp = 0 if tiled_mlp else 2 * 4 * m * b
    lm_head = d * b + 8
    return checkpoints + attention + mlp + lm_head


def choose_num_chunks(
    config,
    sequence_lengths: list[int],
    free_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    offloaded: bool = True,
    tiled_mlp: bool = True,
) -> ChunkChoice:
    """The fewest chunks of about TARGET_CHUNK_TOKENS tokens whose largest fits the budget; one sequence per chunk is
    the floor."""
    per_token = bytes_per_token(config, dtype, offloaded, tiled_mlp)
    budget = int(free_bytes * HEADROOM)
    total = sum(sequence_lengths)
    count = len(sequence_lengths)
    if count == 0:
        return ChunkChoice(1, per_token, budget, "empty batch")
    by_memory = math.ceil(total * per_token / max(budget, 1))
    chunks = min(count, max(1, by_memory, total // TARGET_CHUNK_TOKENS))
    # chunks take near-equal numbers of sequences: make sure the longest such group fits, else split more
    ordered = sorted(sequence_lengths, reverse=True)
    while chunks < count and sum(ordered[: math.ceil(count / chunks)]) * per_token > budget:
        chunks += 1
    largest = sum(ordered[: math.ceil(count / chunks)])
    explanation = (
        f"{total} tokens in {count} sequences x {per_token / 1024:.1f} KiB/token against a budget of "
        f"{budget / 2**30:.2f} GiB -> {chunks} chunk(s), the largest {largest} tokens"
    )
    if largest * per_token > budget:
        explanation += " (one sequence alone exceeds the budget; it may not fit)"
    return ChunkChoice(chunks, per_token, budget, explanation)
