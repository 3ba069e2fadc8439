"""The memory model of the chunked step, and `num_chunks="auto"`.

What one chunk of `tokens` tokens keeps on the GPU, above the resident weights, while it is forwarded and
backpropagated (bytes; d = hidden size, kv = key/value width, m = MLP width, b = bytes per activation element,
L = decoder layers):

per token of the chunk (`bytes_per_token`):
- layer checkpoints: L * d * b with ordinary checkpointing; with offloading only the layer being recomputed and the
  one being prefetched stay: 2 * d * b. A checkpoint under `MIN_OFFLOAD_BYTES` is not offloaded (its copy would cost
  more time than it saves memory), so a short chunk keeps all L of them;
- one layer's recompute, attention: q, attention output, o_proj output, residual and norm outputs (about 6 * d) and
  k, v before and after the KV-head repeat (4 * kv), times b, plus as much again for their gradients in backward;
- one layer's recompute, MLP: gate, up, activation and product (4 * m * b) and the same again for their gradients,
  unless the MLP is tiled, when it is bounded by the tile and not by the chunk;
- the fused LM head: the final hidden states it saves (d * b) and fp32 log-prob/entropy per token (8 bytes);

whatever the chunk's length (`chunk_bytes` adds them):
- the tiled MLP's working set: 8 * m * b for each token of one tile (`mlp_tile_tokens`, or the chunk if shorter);
- the gradients of the trainable parameters, allocated by the first backward of a step (LoRA r=64 on W1's model:
  0.28 GiB in fp32, peft's adapter dtype).

Checked against W1's measured peaks in tests/trainers/test_memory.py (docs/bench/w1_*.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slimrl.models.checkpointing import DEFAULT_MLP_TILE_TOKENS, MIN_OFFLOAD_BYTES

HEADROOM = 0.85  # share of the free memory a chunk may plan to use: the allocator fragments, kernels need workspace
# Memory is a budget, not whatever is free: a chunk holds about this many tokens (unless one sequence is longer).
# At 16k tokens every GEMM of a 1B-class model is large enough to keep the GPU busy, so smaller chunks cost no speed.
TARGET_CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class ChunkChoice:
    num_chunks: int
    bytes_per_token: int
    budget_bytes: int  # the free memory times HEADROOM: what the largest chunk's predicted peak must stay under
    explanation: str
    peak_bytes: int = 0  # the largest chunk's predicted peak above the weights (`chunk_bytes`)


def _shape(config, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(d, kv, m, L, b) of the model's text config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", heads) * (getattr(text, "head_dim", None) or text.hidden_size // heads)
    b = torch.tensor([], dtype=dtype).element_size()
    return text.hidden_size, kv, text.intermediate_size, text.num_hidden_layers, b


def mlp_bytes_per_token(config, dtype: torch.dtype) -> int:
    """The recomputed MLP's activations (gate, up, activation, product) and their gradients, per token."""
    _, _, m, _, b = _shape(config, dtype)
    return 2 * 4 * m * b


def bytes_per_token(config, dtype: torch.dtype, offloaded: bool = True, tiled_mlp: bool = True) -> int:
    """Peak GPU bytes one token of a chunk costs during its forward and backward (see the module docstring)."""
    d, kv, _, layers, b = _shape(config, dtype)
    checkpoints = (2 if offloaded else layers) * d * b
    attention = 2 * (6 * d + 4 * kv) * b  # activations and their gradients
    mlp = 0 if tiled_mlp else mlp_bytes_per_token(config, dtype)
    lm_head = d * b + 8
    return checkpoints + attention + mlp + lm_head


@dataclass(frozen=True)
class ChunkCosts:
    """What a chunk's peak depends on besides its length: the model, the activation dtype, offloaded checkpointing
    (`min_offload_bytes`: smaller checkpoints stay on the GPU), the MLP tile (`mlp_tile_tokens` 0: not tiled; tiling
    needs offloading) and `gradient_bytes` (the trainable parameters' gradients not allocated yet)."""

    config: object
    dtype: torch.dtype = torch.bfloat16
    offloaded: bool = True
    mlp_tile_tokens: int = DEFAULT_MLP_TILE_TOKENS
    gradient_bytes: int = 0
    min_offload_bytes: int = MIN_OFFLOAD_BYTES

    @property
    def tile_tokens(self) -> int:
        return self.mlp_tile_tokens if self.offloaded else 0

    @property
    def per_token(self) -> int:
        return bytes_per_token(self.config, self.dtype, self.offloaded, tiled_mlp=self.tile_tokens > 0)

    def peak(self, tokens: int) -> int:
        """Predicted peak GPU bytes above the resident weights while a chunk of `tokens` tokens runs forward and
        backward: per-token costs, one MLP tile's working set and the gradients."""
        d, _, _, _, b = _shape(self.config, self.dtype)
        parked = self.offloaded and tokens * d * b >= self.min_offload_bytes
        tiled = self.tile_tokens > 0
        tile = mlp_bytes_per_token(self.config, self.dtype) * min(tokens, self.tile_tokens) if tiled else 0
        per_token = bytes_per_token(self.config, self.dtype, offloaded=parked, tiled_mlp=tiled)
        return tokens * per_token + tile + self.gradient_bytes


def chunk_bytes(config, tokens: int, **costs) -> int:
    """`ChunkCosts(config, **costs).peak(tokens)`."""
    return ChunkCosts(config, **costs).peak(tokens)


def choose_num_chunks(costs: ChunkCosts, sequence_lengths: list[int], free_bytes: int) -> ChunkChoice:
    """The fewest chunks of about TARGET_CHUNK_TOKENS tokens whose largest is predicted to fit the budget; one
    sequence per chunk is the floor."""
    per_token, peak = costs.per_token, costs.peak
    budget = int(free_bytes * HEADROOM)
    total = sum(sequence_lengths)
    count = len(sequence_lengths)
    if count == 0:
        return ChunkChoice(1, per_token, budget, "empty batch", peak(0))
    fixed = costs.gradient_bytes + mlp_bytes_per_token(costs.config, costs.dtype) * costs.tile_tokens  # one whole tile
    by_memory = math.ceil(total * per_token / max(budget - fixed, 1))
    chunks = min(count, max(1, by_memory, total // TARGET_CHUNK_TOKENS))
    # chunks take near-equal numbers of sequences: make sure the longest such group fits, else split more
    ordered = sorted(sequence_lengths, reverse=True)
    while chunks < count and peak(sum(ordered[: math.ceil(count / chunks)])) > budget:
        chunks += 1
    largest = sum(ordered[: math.ceil(count / chunks)])
    explanation = (
        f"{total} tokens in {count} sequences x {per_token / 1024:.1f} KiB/token + {fixed / 2**30:.2f} GiB fixed "
        f"against a budget of {budget / 2**30:.2f} GiB -> {chunks} chunk(s), the largest {largest} tokens "
        f"({peak(largest) / 2**30:.2f} GiB)"
    )
    if peak(largest) > budget:
        explanation += " (one sequence alone exceeds the budget; it may not fit)"
    return ChunkChoice(chunks, per_token, budget, explanation, peak(largest))
