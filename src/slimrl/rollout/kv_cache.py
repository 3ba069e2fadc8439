"""The static KV cache of one rollout: one K and one V tensor per layer, allocated once, written in place.

Layout per layer: `[batch, kv_heads, max_len, head_dim]`. Prompts are left-padded to a common length P, so every
sequence writes its t-th new token at the same column P + t: a decode step writes one column for the whole batch
(`index_copy_` at a device-side index, which a CUDA graph can replay) and attention masks the padding columns.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def write_prompt_rows(self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`write_prompt` into the rows listed by `rows` (int64 [b] on the cache's device, one per K/V row), so one
        prefilled prompt can be written into every row that holds it."""
        length = keys.shape[2]
        self.keys[layer][:, :, :length].index_copy_(0, rows, keys)
        self.values[layer][:, :, :length].index_copy_(0, rows, values)

    def write_column(self, layer: int, column: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one decode step's K/V `[batch, kv_heads, head_dim]` at `column` (a 1-element int64 tensor)."""
        self.keys[layer].index_copy_(2, column, keys.unsqueeze(2))
        self.values[layer].index_copy_(2, column, values.unsqueeze(2))

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses a captured graph has baked in; a graph is only valid for the cache it was captured with."""
        return tuple(t.data_ptr() for t in (*self.keys, *self.values))


TABLE_UNIT_BYTES = 64  # the address table counts in these: torch aligns allocations to 64 bytes (CUDA: 512)


def table_unit(dtype: torch.dtype) -> int:
    """Elements per address-table unit for a cache of this dtype."""
    return TABLE_UNIT_BYTES // torch.empty((), dtype=dtype).element_size()


def table_entries(cache: StaticKVCache, anchor: torch.Tensor) -> list[int]:
    """Where each layer's K and V tensors start, counted from `anchor` in table units (K then V per layer).

    A kernel forms the address as `anchor + entry * unit`: the multiplication tells Triton the address is aligned,
    so its loads stay vectorised, which an address loaded as a raw integer would not."""
    unit = TABLE_UNIT_BYTES
    entries = []
    for tensor in (t for pair in zip(cache.keys, cache.values, strict=True) for t in pair):
        delta = tensor.data_ptr() - anchor.data_ptr()
        if delta % unit:
            raise RuntimeError(f"a KV-cache tensor is not {unit}-byte aligned relative to the anchor; cannot table it")
        entries.append(delta // unit)
    return entries


@dataclass
class StepContext:
    """What one decode step's fused kernels share: the cache address table (int64 [2 * layers], K and V tensor
    offsets per layer from `anchor`, in table units), the anchor tensor (cache dtype), the step's cache column
    (int64 [1]) and the cache length; and the split-K scratch (`kernels.gemm.SplitScratch`), held as long as the
    step's graph, or None (no split launches)."""

    table: torch.Tensor
    anchor: torch.Tensor
    column: torch.Tensor
    cache_len: int
    scratch: object = None
