"""Fused projections of the decode step: base GEMM, bias, LoRA and the op that follows, in one Triton launch.

A decode step multiplies a handful of rows by every weight of the model, so each projection is a skinny GEMM that
streams its weights once; what costs time beyond that stream is the number of launches around it. cuBLAS plus
separate kernels for the LoRA update, RoPE, the cache writes and the SwiGLU product spend about 24 launches per
layer. Here a program owns a tile of output columns for all rows and finishes it:

- `qkv_rope_cache`: q, k and v of one layer. A program owns one head (both RoPE halves), computes `x Wᵀ + b`,
  adds the LoRA update from the shrink workspace (`lora_kernels.shrink_`), applies Qwen3's per-head q/k RMSNorm
  when the model has one, rotates q and k, and stores q, and k and v straight into the KV cache at the step's
  column. The cache's addresses are read from a small device table, not baked into the launch, so a captured CUDA
  graph stays valid when the cache is freed after a rollout and allocated again for the next one.
- `project`: one projection (`x Wᵀ + b` plus LoRA), or a pair sharing the input with SwiGLU's `silu(a) * b` as the
  epilogue (gate and up).

Both can also take the base outputs precomputed (for bitsandbytes layers, which dequantise themselves) and then
only add LoRA and run the epilogue. Arithmetic follows transformers and peft in eager mode: the base output is
rounded to the activation dtype, LoRA adds `B(A x) * scale` in the adapter dtype (rounding as peft does for half
adapters), the sum is rounded once, and RoPE and SwiGLU round after each elementwise op as eager bf16 does.
Only summation order differs from the references in `fused_decode.py`; the tests compare the two.
Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slimrl.rollout import pdl
from slimrl.rollout.kv_cache import table_unit
from slimrl.rollout.pdl import enter

# Triton's interpreter (the CPU tests) converts fp32 to bf16 by truncation; there the rounding is done by hand
_SOFT_BF16 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x rounded to `dtype` (to nearest, ties to even) and back to fp32 (a no-op for fp32)."""
    if _SOFT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _gemm_pair(acc0, acc1, x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs_n0, w1_ptr, offs_n1, n_ok, K, k_lo, k_hi,
               BK: tl.constexpr, TWO: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
               DOT_F32: tl.constexpr):  # fmt: skip
    """acc0 += x · w0[offs_n0]ᵀ and, when TWO, acc1 += x · w1[offs_n1]ᵀ (x read once), over columns k_lo..k_hi of K.
    w* are [N, K] row-major."""
    offs_k = tl.arange(0, BK)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + offs_k
        if EVEN_K:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
            w0 = tl.load(w0_ptr + offs_n0[:, None] * K + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = k[None, :] < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w0 = tl.load(w0_ptr + offs_n0[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        x = x.to(w0.dtype)
        if DOT_F32:  # Triton's interpreter multiplies half-precision tiles wrongly; their fp32 products are exact
            x = x.to(tl.float32)
            w0 = w0.to(tl.float32)
        acc0 = tl.dot(x, tl.trans(w0), acc0, input_precision=PRECISION)
        if TWO:
            if EVEN_K:
                w1 = tl.load(w1_ptr + offs_n1[:, None] * K + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                w1 = tl.load(w1_ptr + offs_n1[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
            if DOT_F32:
                w1 = w1.to(tl.float32)
            acc1 = tl.dot(x, tl.trans(w1), acc1, input_precision=PRECISION)
    return acc0, acc1


@triton.jit
def _with_bias(acc, b_ptr, offs_n, n_ok, HAS_BIAS: tl.constexpr, OUT: tl.constexpr):
    """The base projection's output as transformers gets it: fp32 accumulator plus bias, rounded once."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return _round(acc, OUT)


@triton.jit
def _split_gemm(x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, K, sp_ptr, cnt_ptr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr, EVEN_K: tl.constexpr,
                PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The fp32 products of `_gemm_pair` with K split over SPLIT programs (program_id(2)), and whether this program
    holds them (the last of its tile to finish; the others return partial sums and False).

    Each program stores its partial sums in its own slot of sp (fp32, [tiles, SPLIT, 2, BM, BN]) and counts itself
    in cnt[tile] (int32, zero between launches); the last to arrive adds the slots in split order, so the sum
    does not depend on which finished first, and zeroes the count for the next launch."""
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    split = tl.program_id(2)
    k_per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = split * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    acc0, acc1 = _gemm_pair(acc0, acc1, x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, K, k_lo,
                            k_hi, BK, TWO, EVEN_K, PRECISION, DOT_F32)  # fmt: skip
    last = True
    if SPLIT > 1:
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        cells = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        slots = sp_ptr + tile.to(tl.int64) * (SPLIT * 2 * BM * BN)
        tl.store(slots + (2 * split) * (BM * BN) + cells, acc0)
        if TWO:
            tl.store(slots + (2 * split + 1) * (BM * BN) + cells, acc1)
        tl.debug_barrier()  # every thread's partial sums are out before the count is released
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            acc0 = tl.zeros((BM, BN), dtype=tl.float32)
            acc1 = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # in split order; .cg reads the other SMs' stores from L2
                acc0 += tl.load(slots + (2 * s) * (BM * BN) + cells, cache_modifier=".cg")
                if TWO:
                    acc1 += tl.load(slots + (2 * s + 1) * (BM * BN) + cells, cache_modifier=".cg")
            tl.store(cnt_ptr + tile, 0)
    return acc0, acc1, last


@triton.jit
def _base_outputs(x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, b0_ptr, b1_ptr, y0_ptr,
                  y1_ptr, width, K, sp_ptr, cnt_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  TWO: tl.constexpr, GEMM: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_F32: tl.constexpr, OUT: tl.constexpr,
                  SPLIT: tl.constexpr):  # fmt: skip
    """The base projection's outputs at columns offs0 (and offs1 when TWO), rounded as transformers gets them:
    computed here (GEMM, K split over SPLIT programs, see `_split_gemm`) or loaded from y0/y1 [M, width]
    (computed by cuBLAS or a module); and m_ok narrowed to nothing in the programs that do not finish the tile."""
    if GEMM:
        acc0, acc1, last = _split_gemm(x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, K, sp_ptr,
                                       cnt_ptr, BM, BN, BK, TWO, EVEN_K, PRECISION, DOT_F32, SPLIT)  # fmt: skip
        if SPLIT > 1:  # (m_ok & last in int32: the interpreter's bool & broadcast bool gives no bool mask)
            m_ok = (m_ok.to(tl.int32) & last.to(tl.int32)) != 0
        y0 = _with_bias(acc0, b0_ptr, offs0, n_ok, HAS_BIAS, OUT)
        y1 = _with_bias(acc1, b1_ptr, offs1, n_ok, HAS_BIAS, OUT)
    else:
        tile = m_ok[:, None] & n_ok[None, :]
        y0 = tl.load(y0_ptr + offs_m[:, None] * width + offs0[None, :], mask=tile, other=0.0).to(tl.float32)
        y1 = y0
        if TWO:
            y1 = tl.load(y1_ptr + offs_m[:, None] * width + offs1[None, :], mask=tile, other=0.0).to(tl.float32)
    return y0, y1, m_ok


@triton.jit
def _add_lora(y, ws_ptr, group, M, offs_m, m_ok, b_ptr, offs_n, n_ok, R, scale, OUT: tl.constexpr,
              R_PAD: tl.constexpr, ROUND_ADAPTER: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """peft's `result + lora_B(lora_A(x)) * scaling`, rounded to the output dtype; lora_A(x) is the shrink
    workspace [G, M, R_PAD] (fp32), lora_B is [N, R]."""
    offs_r = tl.arange(0, R_PAD)
    xa = tl.load(ws_ptr + (group * M + offs_m[:, None]) * R_PAD + offs_r[None, :], mask=m_ok[:, None], other=0.0)
    b = tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)
    if ROUND_ADAPTER:  # half-precision adapters: each of peft's steps rounds to the adapter dtype
        xa = _round(xa, b.dtype)
    delta = tl.dot(xa, tl.trans(b.to(tl.float32)), input_precision=PRECISION)
    if ROUND_ADAPTER:
        delta = _round(delta, b.dtype)
        delta = _round(delta * scale, b.dtype)
    else:
        delta = delta * scale
    return _round(y + delta, OUT)


@triton.jit
def _proj_kernel(x_ptr, stride_xm, w0_ptr, w1_ptr, b0_ptr, b1_ptr, y0_ptr, y1_ptr, ws_ptr, lb0_ptr, lb1_ptr,
                 s0, s1, out_ptr, an_ptr, wsn_ptr, sp_ptr, cnt_ptr, M, N, K, R, RN, COLS,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr, PAIR: tl.constexpr,
                 GEMM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, ROUND_ADAPTER: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, NEXT: tl.constexpr,
                 RN_PAD: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    OUT = out_ptr.dtype.element_ty
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    lanes = tl.arange(0, BN)
    offs_n = tl.program_id(1) * COLS + lanes  # a program owns COLS <= BN columns (see `tile_columns`)
    n_ok = (offs_n < N) & (lanes < COLS)
    enter(PDL)
    y0, y1, m_ok = _base_outputs(x_ptr, stride_xm, offs_m, offs_m < M, w0_ptr, offs_n, w1_ptr, offs_n, n_ok, b0_ptr,
                                 b1_ptr, y0_ptr, y1_ptr, N, K, sp_ptr, cnt_ptr, BM, BN, BK, PAIR, GEMM, HAS_BIAS,
                                 EVEN_K, PRECISION, DOT_F32, OUT, SPLIT)  # fmt: skip
    tile = m_ok[:, None] & n_ok[None, :]  # (nothing in the split programs that do not finish the tile)
    if HAS_LORA:
        y0 = _add_lora(y0, ws_ptr, 0, M, offs_m, m_ok, lb0_ptr, offs_n, n_ok, R, s0, OUT, R_PAD, ROUND_ADAPTER,
                       PRECISION)  # fmt: skip
        if PAIR:
            y1 = _add_lora(y1, ws_ptr, 1, M, offs_m, m_ok, lb1_ptr, offs_n, n_ok, R, s1, OUT, R_PAD, ROUND_ADAPTER,
                           PRECISION)  # fmt: skip
    out = y0
    if PAIR:  # F.silu(gate) * up in eager: silu in fp32 rounded once, then the product rounded
        out = _round(_round(y0 / (1.0 + tl.exp(-y0)), OUT) * y1, OUT)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out.to(OUT), mask=tile)
    if NEXT:  # the next projection's lora_A(out), this tile's share of it (the workspace was zeroed)
        offs_r = tl.arange(0, RN_PAD)
        a = tl.load(an_ptr + offs_r[:, None] * N + offs_n[None, :], mask=(offs_r[:, None] < RN) & n_ok[None, :],
                    other=0.0)  # fmt: skip
        part = tl.dot(tl.where(tile, out, 0.0), tl.trans(a.to(tl.float32)), input_precision=PRECISION)
        tl.atomic_add(wsn_ptr + offs_m[:, None] * RN_PAD + offs_r[None, :], part, mask=m_ok[:, None], sem="relaxed")


@triton.jit
def _qkv_kernel(x_ptr, stride_xm, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, yq_ptr, yk_ptr, yv_ptr,
                ws_ptr, lbq_ptr, lbk_ptr, lbv_ptr, sq, sk, sv, qn_ptr, kn_ptr, eps_q, eps_k, cos_ptr, sin_ptr,
                q_out_ptr, table_ptr, anchor_ptr, layer, col_ptr, cache_len, sp_ptr, cnt_ptr, M, K, R,
                HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                R_PAD: tl.constexpr, GEMM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                ROUND_ADAPTER: tl.constexpr, QK_NORM: tl.constexpr, EVEN_K: tl.constexpr,
                PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SLICE: tl.constexpr,
                UNIT: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    OUT = q_out_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    PARTS: tl.constexpr = HALF // SLICE  # programs per head: each owns SLICE columns of both RoPE halves
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    j = tl.program_id(1) // PARTS  # which head of q, then k, then v
    part = tl.program_id(1) % PARTS
    if j < HQ:
        kind = 0
        head = j
        w_ptr = wq_ptr
        b_ptr = bq_ptr
        y_ptr = yq_ptr
        lb_ptr = lbq_ptr
        scale = sq
        width = HQ * D
    elif j < HQ + HK:
        kind = 1
        head = j - HQ
        w_ptr = wk_ptr
        b_ptr = bk_ptr
        y_ptr = yk_ptr
        lb_ptr = lbk_ptr
        scale = sk
        width = HK * D
    else:
        kind = 2
        head = j - HQ - HK
        w_ptr = wv_ptr
        b_ptr = bv_ptr
        y_ptr = yv_ptr
        lb_ptr = lbv_ptr
        scale = sv
        width = HK * D
    offs_d = part * SLICE + tl.arange(0, SLICE)
    lo = head * D + offs_d  # this head's first and second RoPE halves
    hi = lo + HALF
    all_n = offs_d < HALF
    enter(PDL)
    y_lo, y_hi, m_ok = _base_outputs(x_ptr, stride_xm, offs_m, offs_m < M, w_ptr, lo, w_ptr, hi, all_n, b_ptr,
                                     b_ptr, y_ptr, y_ptr, width, K, sp_ptr, cnt_ptr, BM, SLICE, BK, True, GEMM,
                                     HAS_BIAS, EVEN_K, PRECISION, DOT_F32, OUT, SPLIT)  # fmt: skip
    if HAS_LORA:
        y_lo = _add_lora(y_lo, ws_ptr, kind, M, offs_m, m_ok, lb_ptr, lo, all_n, R, scale, OUT, R_PAD,
                         ROUND_ADAPTER, PRECISION)  # fmt: skip
        y_hi = _add_lora(y_hi, ws_ptr, kind, M, offs_m, m_ok, lb_ptr, hi, all_n, R, scale, OUT, R_PAD,
                         ROUND_ADAPTER, PRECISION)  # fmt: skip
    if kind < 2:
        if QK_NORM:  # Qwen3: RMSNorm over each head (fp32, rounded, then times the weight); SLICE is HALF here
            n_ptr = qn_ptr
            eps = eps_q
            if kind == 1:
                n_ptr = kn_ptr
                eps = eps_k
            inv = tl.rsqrt((tl.sum(y_lo * y_lo, axis=1) + tl.sum(y_hi * y_hi, axis=1)) / D + eps)[:, None]
            g_lo = tl.load(n_ptr + offs_d).to(tl.float32)[None, :]
            g_hi = tl.load(n_ptr + HALF + offs_d).to(tl.float32)[None, :]
            y_lo = _round(g_lo * _round(y_lo * inv, OUT), OUT)
            y_hi = _round(g_hi * _round(y_hi * inv, OUT), OUT)
        # transformers' q * cos + rotate_half(q) * sin, each op rounded as in eager
        rows = offs_m[:, None] * D
        cos_lo = tl.load(cos_ptr + rows + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + rows + HALF + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + rows + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + rows + HALF + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        r_lo = _round(_round(y_lo * cos_lo, OUT) + _round(-y_hi * sin_lo, OUT), OUT)
        r_hi = _round(_round(y_hi * cos_hi, OUT) + _round(y_lo * sin_hi, OUT), OUT)
        y_lo, y_hi = r_lo, r_hi
    if kind == 0:
        base = q_out_ptr + offs_m[:, None] * (HQ * D) + head * D
    else:  # row b's K (or V) at [b, head, column, :] of this layer's [B, HK, cache_len, D] cache
        cache = anchor_ptr + tl.load(table_ptr + 2 * layer + kind - 1) * UNIT
        column = tl.load(col_ptr)
        base = cache + ((offs_m[:, None] * HK + head) * cache_len + column) * D
    tl.store(base + offs_d[None, :], y_lo.to(OUT), mask=m_ok[:, None])
    tl.store(base + HALF + offs_d[None, :], y_hi.to(OUT), mask=m_ok[:, None])


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, ADD: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    """One row: h + d rounded to h's dtype (stored), then LlamaRMSNorm of it (fp32 statistics, the normalised row
    rounded to h's dtype, times the weight in the output's dtype)."""
    enter(PDL)
    OUT = h_out_ptr.dtype.element_ty
    Y = y_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    h = tl.load(h_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        h = _round(h + tl.load(d_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32), OUT)
        tl.store(h_out_ptr + row * N + offs, h.to(OUT), mask=ok)
    normed = _round(h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps), OUT)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (w * normed).to(Y), mask=ok)


# -- launch helpers -------------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block_m(rows: int, block_m: int = 0) -> int:
    """Rows per program: `block_m` when given (16 ... 128), else the smallest of 16, 32, 64 that holds them."""
    if block_m:
        return block_m
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any count exercises the same arithmetic
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def tile_columns(width: int, row_blocks: int, block_n: int, per_sm: int, device: torch.device) -> int:
    """Output columns per program. With per_sm = 0 a program owns a full tile of block_n. Otherwise the columns are
    spread so that the launch has about per_sm programs per SM (at most block_n each): a skinny decode GEMM that
    needs 140 full tiles on 132 SMs takes two waves for 1.06 waves' work; 132 narrower tiles take one."""
    if not per_sm:
        return block_n
    programs = max(1, per_sm * _sm_count(device) // row_blocks)
    return max(1, min(block_n, triton.cdiv(width, programs)))


class SplitScratch:
    """Partial-sum slots and arrival counts of the split-K launches (`_split_gemm`), one pair per device.

    A captured graph bakes their addresses in, so they live as long as the owner (the engine's decode session, with
    its graph): they grow outside a capture (the warm-up steps before one see every shape) and are never freed
    while held; a launch that needs more room during a capture runs unsplit instead. The counts are zero between
    launches (each tile's last program resets its own)."""

    def __init__(self):
        self._held: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._outgrown: list = []  # superseded buffers an earlier capture may still read

    def take(self, device: torch.device, elements: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        held = self._held.get(device)
        if held is not None and held[0].numel() >= elements and held[1].numel() >= tiles:
            return held
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if held is not None:
            self._outgrown.append(held)
            elements, tiles = max(elements, held[0].numel()), max(tiles, held[1].numel())
        held = (torch.empty(elements, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))  # fmt: skip
        self._held[device] = held
        return held


def _split_args(split_k: int, scratch, x: torch.Tensor, tiles: int, block_m: int, block_n: int, block_k: int):
    """(SPLIT, partials, counts) for a launch of `tiles` output tiles: K split into at most split_k even shares of
    whole K steps when a scratch has room, else unsplit (placeholders for the unused pointers)."""
    steps = triton.cdiv(x.shape[1], block_k)
    split = triton.cdiv(steps, triton.cdiv(steps, max(1, min(split_k, steps))))
    if split > 1 and scratch is not None:
        held = scratch.take(x.device, tiles * split * 2 * block_m * block_n, tiles)
        if held is not None:
            return split, held[0], held[1]
    return 1, x, x


def _precision(dtype: torch.dtype, tf32: bool) -> str:
    return "tf32" if tf32 and dtype != torch.float32 else "ieee"


def can_run_qkv(head_dim: int, dtype: torch.dtype) -> bool:
    """Head dims whose halves tl.dot can tile (32 ... 256, powers of two) in the dtypes it takes."""
    return 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16,
                                                                                  torch.float32)  # fmt: skip


def qkv_rope_cache(x, weights, biases, outputs, lora, norms, cos, sin, q_out, table, anchor, layer, column, cache_len,
                   heads, kv_heads, head_dim, block_k=64, tf32=True, num_warps=4, num_stages=3,
                   slice_cols=0, block_m=0, split_k=1, scratch=None) -> None:  # fmt: skip
    """q, k, v of one decode step's layer, LoRA, Qwen3 norms and RoPE applied; q into q_out [M, heads*D], k and v
    into the cache at `column` of the layer's tensors found through table[2*layer] (K) and table[2*layer+1] (V) (see
    `kv_cache.table_entries`; anchor is a tensor of the cache's dtype).

    x [M, K] (the normed hidden). Either weights = (Wq, Wk, Wv) [N, K] contiguous with biases = (bq, bk, bv) or None
    (the kernel does the GEMM), or outputs = (yq, yk, yv) [M, N] contiguous base outputs (bias included).
    lora: None or (workspace [3, M, R_PAD] fp32 from `shrink_`, (Bq, Bk, Bv) [N, R] contiguous, (sq, sk, sv)).
    norms: None or ((q_norm weight, eps), (k_norm weight, eps)). cos/sin [M, D] for each row's position.
    slice_cols: columns of each RoPE half one program computes (a divisor of D/2, at least 16; 0 = all): smaller
    gives more programs for few heads. Qwen3's per-head norm needs the whole head, so it always takes all.
    block_m: rows per program (0 = the smallest tile that holds them, up to 64). split_k: programs that share each
    tile's K (`_split_gemm`; with the kernel's own GEMM and a `SplitScratch` only).
    """
    rows, features = x.shape
    gemm = weights is not None
    w = weights if gemm else outputs
    has_bias = gemm and biases is not None and biases[0] is not None
    b = biases if has_bias else (w[0],) * 3
    y = outputs if not gemm else (x,) * 3
    if lora is not None:
        workspace, lora_bs, scales = lora
        rank = lora_bs[0].shape[1]
        r_pad = workspace.shape[-1]
        round_adapter = lora_bs[0].dtype != torch.float32
    else:
        workspace, lora_bs, scales, rank, r_pad, round_adapter = x, (x,) * 3, (1.0,) * 3, 1, 16, False
    if norms is not None:
        (qn, eps_q), (kn, eps_k) = norms
    else:
        qn, kn, eps_q, eps_k = x, x, 0.0, 0.0
    weights_or_x = w if gemm else (x,) * 3
    half = head_dim // 2
    slice_cols = half if norms is not None or not slice_cols else max(16, min(half, slice_cols))
    if half % slice_cols:
        slice_cols = half
    block_m = _block_m(rows, block_m)
    tiles = (triton.cdiv(rows, block_m), (heads + 2 * kv_heads) * (half // slice_cols))
    split, partials, counts = _split_args(split_k if gemm else 1, scratch, x, tiles[0] * tiles[1], block_m,
                                          slice_cols, block_k)  # fmt: skip
    _qkv_kernel[(*tiles, split)](
        x, x.stride(0), *weights_or_x, *b, *y, workspace, *lora_bs, *(float(s) for s in scales), qn, kn,
        float(eps_q), float(eps_k), cos, sin, q_out, table, anchor, layer, column, cache_len, partials, counts, rows,
        features, rank,
        HQ=heads, HK=kv_heads, D=head_dim, BM=block_m, BK=block_k, R_PAD=r_pad, GEMM=gemm, HAS_BIAS=has_bias,
        HAS_LORA=lora is not None, ROUND_ADAPTER=round_adapter, QK_NORM=norms is not None,
        EVEN_K=features % block_k == 0, PRECISION=_precision(x.dtype, tf32), DOT_F32=_interpreting(),
        SLICE=slice_cols, UNIT=table_unit(q_out.dtype), SPLIT=split, num_warps=num_warps, num_stages=num_stages,
        **pdl.options(x.device),
    )  # fmt: skip


def project(x, weights, biases, outputs, lora, out, pair: bool, block_n=32, block_k=64, tf32=True, num_warps=4,
            num_stages=3, next_shrink=None, block_m=0, per_sm=0, split_k=1, scratch=None) -> torch.Tensor:  # fmt: skip
    """out [M, N] = x W0ᵀ + b0 + LoRA0, or with pair=True silu(that) * (x W1ᵀ + b1 + LoRA1).

    weights (W0[, W1]) [N, K] contiguous and biases (or None) for the GEMM, or outputs (y0[, y1]) [M, N] contiguous
    precomputed base outputs; lora None or (workspace [G, M, R_PAD], (B0[, B1]), (s0[, s1])).
    next_shrink: None or (A [R', N] contiguous, workspace [M, R'_PAD] zeroed fp32): also accumulate out · Aᵀ there,
    the LoRA shrink of the projection that reads `out` next. block_m: rows per program (0 = up to 64 by the row
    count); per_sm: spread the columns over about that many programs per SM (`tile_columns`); split_k: programs
    that share each tile's K (`_split_gemm`; with the kernel's own GEMM and a `SplitScratch` only). Returns out."""
    rows, features = x.shape
    gemm = weights is not None
    has_bias = gemm and biases is not None and biases[0] is not None
    w = tuple(weights) if gemm else (x,)
    width = (weights[0] if gemm else outputs[0]).shape[0 if gemm else 1]
    b = tuple(biases) if has_bias else (x,)
    y = tuple(outputs) if not gemm else (x,)
    if lora is not None:
        workspace, lora_bs, scales = lora
        lora_bs, scales = tuple(lora_bs), tuple(float(s) for s in scales)
        rank, r_pad = lora_bs[0].shape[1], workspace.shape[-1]
        round_adapter = lora_bs[0].dtype != torch.float32
    else:
        workspace, lora_bs, scales, rank, r_pad, round_adapter = x, (x,), (1.0,), 1, 16, False

    def two(items):
        return (items[0], items[1] if len(items) > 1 else items[0])

    next_a, next_ws = next_shrink if next_shrink is not None else (x, x)
    next_rank = next_a.shape[0] if next_shrink is not None else 1
    next_pad = next_ws.shape[-1] if next_shrink is not None else 16
    block_m = _block_m(rows, block_m)
    row_blocks = triton.cdiv(rows, block_m)
    cols = tile_columns(width, row_blocks, block_n, per_sm, x.device)
    tiles = (row_blocks, triton.cdiv(width, cols))
    split, partials, counts = _split_args(split_k if gemm else 1, scratch, x, tiles[0] * tiles[1], block_m, block_n,
                                          block_k)  # fmt: skip
    _proj_kernel[(*tiles, split)](
        x, x.stride(0), *two(w), *two(b), *two(y), workspace, *two(lora_bs), *two(scales), out, next_a, next_ws,
        partials, counts, rows, width, features, rank, next_rank, cols, BM=block_m, BN=block_n, BK=block_k,
        R_PAD=r_pad, PAIR=pair, SPLIT=split,
        GEMM=gemm, HAS_BIAS=has_bias, HAS_LORA=lora is not None, ROUND_ADAPTER=round_adapter,
        EVEN_K=features % block_k == 0, PRECISION=_precision(x.dtype, tf32), DOT_F32=_interpreting(),
        NEXT=next_shrink is not None, RN_PAD=next_pad, num_warps=num_warps, num_stages=num_stages,
        **pdl.options(x.device),
    )  # fmt: skip
    return out


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(hidden + delta, its RMSNorm) as `llama.add_rms_norm` computes them, in one launch; with delta None,
    (hidden, its RMSNorm). hidden and delta [M, N] contiguous of one dtype, weight [N]."""
    rows, width = hidden.shape
    out = torch.empty_like(hidden) if delta is not None else hidden
    normed = torch.empty(rows, width, dtype=torch.promote_types(weight.dtype, hidden.dtype), device=hidden.device)
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(rows,)](
        hidden, delta if delta is not None else hidden, weight, out, normed, width, float(eps), BLOCK=block,
        ADD=delta is not None, num_warps=4 if block <= 2048 else 8, **pdl.options(hidden.device),
    )  # fmt: skip
    return out, normed
