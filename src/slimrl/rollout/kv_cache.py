"""The static KV cache of one rollout: one K and one V tensor per layer, allocated once, written in place.

Layout per layer: `[batch, kv_heads, max_len, head_dim]`. Prompts are left-padded to a common length P, so every
sequence writes its t-th new token at the same column P + t: a decode step writes one column for the whole batch
(`index_copy_` at a device-side index, which a CUDA graph can replay) and attention masks the padding columns.

With a shared prefix (`prefix_rows`, `prefix_len`), the prompts are held once each: per layer a prefix K and V
`[prefix_rows, kv_heads, prefix_len, head_dim]` (distinct prompt j left-padded in row j) and the rows' own columns
`[batch, kv_heads, max_len, head_dim]` after it. Row b's column c is then prefix column c of its prompt's row
(`source[b]`) for c < prefix_len, else its own column c - prefix_len: GRPO's G completions of a prompt keep one copy
of it, not G.
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
        prefix_rows: int = 0,
        prefix_len: int = 0,
    ):
        shape = (batch, kv_heads, max_len, head_dim)
        self.batch, self.max_len = batch, max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.prefix_rows, self.prefix_len = (prefix_rows, prefix_len) if prefix_rows and prefix_len else (0, 0)
        prefix = (prefix_rows, kv_heads, prefix_len, head_dim)
        layers = range(num_layers if self.prefix_len else 0)
        self.prefix_keys = [torch.zeros(prefix, dtype=dtype, device=device) for _ in layers]
        self.prefix_values = [torch.zeros(prefix, dtype=dtype, device=device) for _ in layers]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values, *self.prefix_keys, *self.prefix_values)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

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

    def write_prefix(self, layer: int, rows: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a prefill's K/V `[b, kv_heads, P, head_dim]` of distinct prompts `rows` in the last P columns of
        their prefix rows (the prompts end where the rows' own columns begin)."""
        start = self.prefix_len - keys.shape[2]
        self.prefix_keys[layer][rows, :, start:].copy_(keys)
        self.prefix_values[layer][rows, :, start:].copy_(values)

    def write_column(self, layer: int, column: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one decode step's K/V `[batch, kv_heads, head_dim]` at `column` (a 1-element int64 tensor) of the
        rows' own columns (with a prefix: the row's column minus prefix_len)."""
        self.keys[layer].index_copy_(2, column, keys.unsqueeze(2))
        self.values[layer].index_copy_(2, column, values.unsqueeze(2))

    def rows(self, layer: int, source: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V as every row sees them, `[batch, kv_heads, prefix_len + max_len, head_dim]`: its
        own columns, after its prompt's prefix row (`source`: int64 [batch], each row's prefix row) when there is a
        prefix, which is then gathered into a new tensor (the plain-PyTorch path; the Triton kernel reads the prefix
        in place)."""
        if not self.prefix_len:
            return self.keys[layer], self.values[layer]
        keys = torch.cat([self.prefix_keys[layer].index_select(0, source), self.keys[layer]], dim=2)
        values = torch.cat([self.prefix_values[layer].index_select(0, source), self.values[layer]], dim=2)
        return keys, values

    def data_ptrs(self) -> tuple[int, ...]:
        """Addresses a captured graph has baked in; a graph is only valid for the cache it was captured with."""
        return tuple(t.data_ptr() for t in self.tensors())


TABLE_UNIT_BYTES = 64  # the address table counts in these: torch aligns allocations to 64 bytes (CUDA: 512)


def table_unit(dtype: torch.dtype) -> int:
    """Elements per address-table unit for a cache of this dtype."""
    return TABLE_UNIT_BYTES // torch.empty((), dtype=dtype).element_size()


def table_entries(cache: StaticKVCache, anchor: torch.Tensor, prefix: bool = False) -> list[int]:
    """Where each layer's K and V tensors start, counted from `anchor` in table units (K then V per layer); with
    `prefix`, those of the prefix tensors (which must exist).

    A kernel forms the address as `anchor + entry * unit`: the multiplication tells Triton the address is aligned,
    so its loads stay vectorised, which an address loaded as a raw integer would not."""
    unit = TABLE_UNIT_BYTES
    entries = []
    keys, values = (cache.prefix_keys, cache.prefix_values) if prefix else (cache.keys, cache.values)
    if prefix and not keys:
        raise ValueError("this cache has no prefix tensors to table")
    for tensor in (t for pair in zip(keys, values, strict=True) for t in pair):
        delta = tensor.data_ptr() - anchor.data_ptr()
        if delta % unit:
            raise RuntimeError(f"a KV-cache tensor is not {unit}-byte aligned relative to the anchor; cannot table it")
        entries.append(delta // unit)
    return entries


@dataclass
class StepContext:
    """What one decode step's fused kernels share: the cache address table (int64 [2 * layers], K and V tensor
    offsets per layer from `anchor`, in table units), the anchor tensor (cache dtype), the column the step writes
    (int64 [1]; of the rows' own columns, past a shared prefix) and the rows' column count; and the split-K scratch
    (`kernels.gemm.SplitScratch`), held as long as the step's graph, or None (no split launches)."""

    table: torch.Tensor
    anchor: torch.Tensor
    column: torch.Tensor
    cache_len: int
    scratch: object = None
