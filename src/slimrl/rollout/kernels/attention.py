"""Decode attention in one Triton launch per layer: one new query per sequence against its live cache columns.

With left-padded prompts, sequence b's keys are the columns [start_b, end] of its cache row (start_b = its padding,
end = the column just written, the same for all rows). One program per (sequence, kv head) loads the `group` query
heads that share the kv head as the rows of one tile, and streams those columns once with an online softmax: no mask
tensor, no repeat of K/V, and the unused columns past `end` are never read (SDPA reads the whole static row).
Few rows make few such programs (8 rows of a 2-kv-head model: 16 on 132 SMs), so the live columns may be cut into
`splits` runs of whole tiles, a program each (flash-decoding): each keeps its own running max, sum and output, and
the last of a (sequence, kv head)'s programs to finish merges them in split order, so the result does not depend
on which program finished first (see `context_splits` for how many).
The reference is `F.scaled_dot_product_attention` with the additive mask (the other branch of
`model.llama.decode_attention`); the tests compare the two, on CUDA and in Triton's interpreter.
Import this module only where Triton may be used.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels import interpreting
from slimrl.rollout.kernels.common import enter, last_to_arrive, round_to
from slimrl.rollout.kernels.common import options as launch_options
from slimrl.rollout.kernels.gemm import SplitScratch
from slimrl.rollout.kv_cache import table_unit

__all__ = ["Prefix", "SplitScratch", "can_run", "context_splits", "decode_attention", "launch_tiles"]

BLOCK_S = 64  # cache columns per step of the loop (default; `decode_attention(block_s=...)`)


def can_run(head_dim: int, dtype: torch.dtype) -> bool:
    """Power-of-two head dims (16 ... 256) in the dtypes tl.dot takes."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and dtype in dtypes


@triton.jit
def _attend_columns(q, k_base, v_base, stride_ks, lo, hi, shift, m_i, l_i, acc, scale, D: tl.constexpr,
                    BLOCK_S: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """The online softmax's update over columns [lo, hi) of one K/V row, column c read at tensor column c - shift;
    tiles start at multiples of BLOCK_S (of c), so a row split in two tensors at a multiple of BLOCK_S is read in
    the same tiles as one."""
    offs_d = tl.arange(0, D)
    first = (lo // BLOCK_S) * BLOCK_S
    for s0 in range(first, hi, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        live = (offs_s >= lo) & (offs_s < hi)
        where = (offs_s - shift)[:, None] * stride_ks + offs_d[None, :]
        k = tl.load(k_base + where, mask=live[:, None], other=0.0)
        if DOT_F32:  # Triton's interpreter multiplies half-precision tiles wrongly; their fp32 products are exact
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_S] fp32
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + where, mask=live[:, None], other=0.0)
        if DOT_F32:
            pv = tl.dot(round_to(p, v.dtype), v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _split_columns(start, end, split, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Columns [lo, hi) of `split` of SPLITS shares of [start, end): the tiles of BLOCK_S columns (counted from
    column 0, as `_attend_columns` reads them) that hold any of them, dealt out in runs of equal length (the last
    runs may be empty). With SPLITS 1: [start, end)."""
    first = (start // BLOCK_S) * BLOCK_S
    run = tl.cdiv(tl.cdiv(end - first, BLOCK_S), SPLITS) * BLOCK_S
    return tl.maximum(start, first + split * run), tl.minimum(end, first + (split + 1) * run)


@triton.jit
def _merge_splits(acc, m_i, l_i, sp_ptr, cnt_ptr, tile, split, g_ok, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                  D: tl.constexpr):  # fmt: skip
    """(output sums, softmax sum, whether this program holds them) of one (sequence, kv head) `tile` whose columns
    SPLITS programs share. Each stores its unnormalised output, running max and sum in its slot of sp (fp32,
    [tiles, SPLITS, BLOCK_G * D + 2 * BLOCK_G]) and counts itself in cnt[tile] (`common.last_to_arrive`); the
    last to arrive rescales every slot to the common max and adds them in split order (an empty split's max is -inf:
    it adds nothing)."""
    offs_g = tl.arange(0, BLOCK_G)
    cells = offs_g[:, None] * D + tl.arange(0, D)[None, :]
    width: tl.constexpr = BLOCK_G * D + 2 * BLOCK_G
    slots = sp_ptr + tile.to(tl.int64) * (SPLITS * width)
    tl.store(slots + split * width + cells, acc, mask=g_ok)
    tl.store(slots + split * width + BLOCK_G * D + offs_g, m_i)
    tl.store(slots + split * width + BLOCK_G * D + BLOCK_G + offs_g, l_i)
    last = last_to_arrive(cnt_ptr, tile, SPLITS)
    if last:  # .cg: the other SMs' stores, read from L2
        top = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        for s in range(0, SPLITS):
            top = tl.maximum(top, tl.load(slots + s * width + BLOCK_G * D + offs_g, cache_modifier=".cg"))
        acc = tl.zeros((BLOCK_G, D), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        for s in range(0, SPLITS):  # in split order
            weight = tl.exp(tl.load(slots + s * width + BLOCK_G * D + offs_g, cache_modifier=".cg") - top)
            l_i += weight * tl.load(slots + s * width + BLOCK_G * D + BLOCK_G + offs_g, cache_modifier=".cg")
            acc += weight[:, None] * tl.load(slots + s * width + cells, mask=g_ok, other=0.0, cache_modifier=".cg")
    return acc, l_i, last


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, start_ptr, end_ptr, table_ptr, anchor_ptr, layer, scale,
                             stride_kb, stride_kh, stride_ks, pk_ptr, pv_ptr, ptable_ptr, source_ptr, prefix_len,
                             stride_pb, stride_ph, sp_ptr, cnt_ptr, HEADS: tl.constexpr, GROUP: tl.constexpr,
                             BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
                             FROM_TABLE: tl.constexpr, UNIT: tl.constexpr, DOT_F32: tl.constexpr,
                             PREFIX: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    if FROM_TABLE:  # the cache's place comes from the device table, so a captured graph outlives the cache
        k_ptr = anchor_ptr + tl.load(table_ptr + 2 * layer) * UNIT
        v_ptr = anchor_ptr + tl.load(table_ptr + 2 * layer + 1) * UNIT
        if PREFIX:
            pk_ptr = anchor_ptr + tl.load(ptable_ptr + 2 * layer) * UNIT
            pv_ptr = anchor_ptr + tl.load(ptable_ptr + 2 * layer + 1) * UNIT
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(start_ptr + b).to(tl.int32)
    end = tl.load(end_ptr).to(tl.int32) + 1  # exclusive
    lo, hi = _split_columns(start, end, tl.program_id(2), SPLITS, BLOCK_S)  # this program's share of them
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g[:, None] < GROUP
    q_rows = b * HEADS + h * GROUP + offs_g  # q and out are [B, HEADS, D] contiguous
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=g_ok, other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, D), dtype=tl.float32)
    own = 0  # the first column held in the row's own tensors
    if PREFIX:  # columns before prefix_len: the prompt's one copy, in prefix row source[b]
        row = tl.load(source_ptr + b)
        m_i, l_i, acc = _attend_columns(q, pk_ptr + row * stride_pb + h * stride_ph,
                                        pv_ptr + row * stride_pb + h * stride_ph, stride_ks, lo,
                                        tl.minimum(hi, prefix_len), 0, m_i, l_i, acc, scale, D, BLOCK_S, PRECISION,
                                        DOT_F32)  # fmt: skip
        own = prefix_len
    m_i, l_i, acc = _attend_columns(q, k_ptr + b * stride_kb + h * stride_kh, v_ptr + b * stride_kb + h * stride_kh,
                                    stride_ks, tl.maximum(lo, own), hi, own, m_i, l_i, acc, scale, D, BLOCK_S,
                                    PRECISION, DOT_F32)  # fmt: skip
    if SPLITS > 1:  # only the last of the splits to finish holds the merged sums and stores them
        acc, l_i, last = _merge_splits(acc, m_i, l_i, sp_ptr, cnt_ptr, b * tl.num_programs(1) + h, tl.program_id(2),
                                       g_ok, SPLITS, BLOCK_G, D)  # fmt: skip
        g_ok = (g_ok.to(tl.int32) & last.to(tl.int32)) != 0  # (int32: the interpreter's bool & gives no bool mask)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok)


class Prefix(NamedTuple):
    """A shared prompt cache as `decode_attention` reads it: each row's prefix row (int64 [B]), the prefix's column
    count, its K and V tensors `[rows, kv_heads, length, D]` (with a table: for their strides only) and its address
    table (K and V per layer, `kv_cache.table_entries(prefix=True)`) or None."""

    source: torch.Tensor
    length: int
    keys: torch.Tensor
    values: torch.Tensor
    table: torch.Tensor | None = None


SPLIT_MIN_COLUMNS = 128  # cache columns a split must have at least (one tile of the widest launch)
MAX_SPLITS = 32
FALLBACK_SMS = 132  # an H100's, for the interpreter (so the tests take the splits an H100 would)


def context_splits(batch: int, kv_heads: int, columns: int, device: torch.device) -> int:
    """How many programs share each (sequence, kv head)'s live columns of a cache of `columns`: as many as keep the
    launch within one program per SM (a launch of 128-column tiles holds a whole SM's shared memory; a second wave
    costs more than the split saves), each with at least SPLIT_MIN_COLUMNS of the columns, at most MAX_SPLITS; 1
    when the sequences and kv heads alone fill the SMs. Measured on the H100 with bench/tune_decode.py at W1's
    shapes (docs/bench/issue34/tune_attention_splits.json): 8 rows of 1,536 columns 15.0 us unsplit, 8.4 in 8
    splits; 64 rows of 512, 7.3 unsplit, 11.4 in 2 (two waves)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else FALLBACK_SMS
    return max(1, min(sms // (batch * kv_heads), columns // SPLIT_MIN_COLUMNS, MAX_SPLITS))


TILE_BYTES = 32 * 1024  # one K tile's bytes: its K and V tiles, double-buffered, fit an H100's 227 KiB shared memory


def launch_tiles(batch: int, dtype: torch.dtype, head_dim: int) -> dict:
    """`decode_attention`'s launch settings: tiles of 128 columns and 8 warps up to 64 rows of 2-byte values
    (bench/tune_decode.py on an H100, W1's shapes), where the tile fits; else the widest of BLOCK_S, 32, 16 columns
    that fits (Gemma 3's head_dim 256: 64 columns in bf16, 32 in fp32; measured on an H100, 128 bf16 columns of 256
    needed 268 KiB)."""
    def fits(block: int) -> bool:
        return block * head_dim * dtype.itemsize <= TILE_BYTES

    if batch <= 64 and dtype.itemsize <= 2 and fits(128):
        return {"block_s": 128, "num_warps": 8}
    block = BLOCK_S
    while block > 16 and not fits(block):
        block //= 2
    return {} if block == BLOCK_S else {"block_s": block}


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    end: torch.Tensor,
    scale: float,
    layer: int = 0,
    table: torch.Tensor | None = None,
    anchor: torch.Tensor | None = None,
    block_s: int = BLOCK_S,
    num_warps: int = 4,
    prefix: Prefix | None = None,
    splits: int = 1,
    scratch=None,
) -> torch.Tensor:
    """softmax(q kᵀ · scale) v over each row's columns [starts[b], end].

    q [B, heads, D]; keys/values [B, kv_heads, S, D] (the static cache); starts [B] and end [1] int tensors on the
    device (no host sync). With `table` and `anchor` (see `kv_cache.table_entries`), the K and V tensors found at
    table[2*layer] and table[2*layer+1] are read instead of keys/values, which then only give the shape.
    With `prefix` (a shared prompt cache, see `kv_cache`): columns c < prefix.length are read from the prefix row
    prefix.source[b], the others at c - prefix.length of keys/values; its table (with `table`) or tensors likewise.
    splits > 1: that many programs share each row's columns (see the module docstring), their partial sums and
    counts in `scratch` (a `gemm.SplitScratch`); unsplit without one, or during a capture that finds it too small.
    Returns [B, heads, D].
    """
    batch, heads, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    from_table = table is not None
    if prefix is not None:
        if keys.stride(2) != prefix.keys.stride(2) or (from_table and prefix.table is None) or prefix.length % block_s:
            raise ValueError("a prefix needs the cache's column stride, a length that is a multiple of block_s (its "
                             "tiles end where the rows' own columns begin) and a table when the cache is read by one")
        pk, pv, ptable = (q, q, prefix.table) if from_table else (prefix.keys, prefix.values, starts)
        source, length, stride_pb, stride_ph = prefix.source, prefix.length, *prefix.keys.stride()[:2]
    else:
        pk, pv, ptable, source, length, stride_pb, stride_ph = q, q, starts, starts, 0, 0, 0
    block_g = max(16, triton.next_power_of_2(group))
    partials, counts, splits = q, q, max(1, splits)
    if splits > 1:
        tiles = batch * kv_heads
        held = None if scratch is None else scratch.take(q.device, tiles * splits * (block_g * dim + 2 * block_g),
                                                         tiles, purpose="attention")  # fmt: skip
        partials, counts, splits = (q, q, 1) if held is None else (*held, splits)
    _decode_attention_kernel[(batch, kv_heads, splits)](
        q, q if from_table else keys, q if from_table else values, out, starts, end, table if from_table else starts,
        anchor if from_table else q, layer, scale, keys.stride(0), keys.stride(1), keys.stride(2), pk, pv, ptable,
        source, length, stride_pb, stride_ph, partials, counts,
        HEADS=heads, GROUP=group, BLOCK_G=block_g, D=dim, BLOCK_S=block_s,
        PRECISION=precision, FROM_TABLE=from_table, UNIT=table_unit(q.dtype), DOT_F32=interpreting(),
        PREFIX=prefix is not None, SPLITS=splits,
        num_warps=num_warps,
        **launch_options(q.device),
    )  # fmt: skip
    return out
