"""The static KV cache of one rollout: one K and one V tensor per layer, allocated once, written in place.

Layout per layer: `[batch, kv_heads, max_len, head_dim]`. Prompts are left-padded to a common length P, so every
sequence writes its t-th new token at the same column P + t: a decode step writes one column for the whole batch
(`index_copy_` at a device-side index, which a CUDA graph can replay) and attention masks the padding columns.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token occupies in the cache across all layers (K and V)."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class StaticKVCache:
    """Pre-allocated K/V tensors for `batch` sequences of up to `max_len` tokens.

    Zero-filled on purpose: attention multiplies masked columns by a zero weight, and 0 * NaN from uninitialised
    memory would still poison the output.
    """

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (batch, kv_heads, max_len, head_dim)
        self.batch, self.max_len = batch, max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def write_prompt(self, layer: int, rows: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a prefill's K/V `[b, kv_heads, P, head_dim]` in columns [0, P) of the given rows."""
        length = keys.shape[2]
        self.keys[layer][rows, :, :length].copy_(keys)
        self.values[layer][rows, :, :length].copy_(values)

    def write_column(self, layer: int, column: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one decode step's K/V `[batch, kv_heads, head_dim]` at `column` (a 1-element int64 tensor)."""
        self.keys[layer].index_copy_(2, column, keys.unsqueeze(2))
        self.values[layer].index_copy_(2, column, values.unsqueeze(2))

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses a captured graph has baked in; a graph is only valid for the cache it was captured with."""
        return tuple(t.data_ptr() for t in (*self.keys, *self.values))
