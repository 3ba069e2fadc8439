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
only add LoRA and run the epilogue. In a decode step both can compute the LoRA shrink of their input themselves
(`fuse`): their first programs to start are producers of the workspace (`gemm.produce_shrink`) and the others wait
for it only before their LoRA epilogue, which saves the step a `shrink_` launch per projection group (and the
deterministic mode its ordered sums: the producers add their chunks in a fixed order).

Arithmetic follows transformers and peft in eager mode: the base output is rounded to the activation dtype, LoRA
adds `B(A x) * scale` in the adapter dtype (rounding as peft does for half adapters), the sum is rounded once, and
RoPE and SwiGLU round after each elementwise op as eager bf16 does.
Only summation order differs from the references in `fused_decode.py`; the tests compare the two.
Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels import interpreting
from slimrl.rollout.kernels.common import block_m as rows_per_program
from slimrl.rollout.kernels.common import enter, precision, round_to, tile_columns
from slimrl.rollout.kernels.common import options as launch_options
from slimrl.rollout.kernels.gemm import (
    PRODUCER_K,
    SplitScratch,
    add_lora_with,
    arrive,
    await_producers,
    base_outputs,
    leave,
    lora_b_tiles,
    producer_grid,
    producer_rows,
    split_args,
)
from slimrl.rollout.kv_cache import table_unit

__all__ = ["SplitScratch", "can_run_qkv", "project", "qkv_rope_cache"]

# launches over at most this many rows load their lora_B tiles before the main loop (`gemm.add_lora_with`): W2's
# deterministic 8-row step took 2.126 against 2.184 ms on the H200, with the same tokens; at 64 rows it was no faster
# (medians -0.7% to +0.5%), and gate/up at 256 rows 20% slower alone (its registers), so larger launches load them after
# (docs/bench/issue34/early_lora_b_and_l2_prefetch_h200.json, early_lora_b_h200.json)
EARLY_B_ROWS = 16


@triton.jit
def _proj_kernel(x_ptr, stride_xm, w0_ptr, w1_ptr, b0_ptr, b1_ptr, y0_ptr, y1_ptr, ws_ptr, lb0_ptr, lb1_ptr,
                 s0, s1, out_ptr, an_ptr, wsn_ptr, sp_ptr, cnt_ptr, la0_ptr, la1_ptr, psp_ptr, pcnt_ptr, st_ptr, M,
                 N, K, R, RN, COLS, ROW_BLOCKS, COL_TILES, PRODUCED, CHUNKS,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr, PAIR: tl.constexpr,
                 GEMM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, ROUND_ADAPTER: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, NEXT: tl.constexpr,
                 RN_PAD: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, PM: tl.constexpr,
                 PK: tl.constexpr, SHRINK_PRECISION: tl.constexpr, EARLY_B: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    OUT = out_ptr.dtype.element_ty
    enter(PDL)
    # the first programs to arrive compute lora_A(x) when FUSED (`gemm.produce_shrink`); c < 0 for them
    c = arrive(st_ptr, x_ptr, stride_xm, M, K, la0_ptr, la1_ptr, la1_ptr, ws_ptr, R, psp_ptr, pcnt_ptr, PRODUCED,
               CHUNKS, FUSED, PM, PK, R_PAD, SHRINK_PRECISION)  # fmt: skip
    if c >= 0:  # this program's output tile (row block fastest) and K split
        pid_m = c % ROW_BLOCKS
        pid_n = (c // ROW_BLOCKS) % COL_TILES
        offs_m = pid_m * BM + tl.arange(0, BM)
        lanes = tl.arange(0, BN)
        offs_n = pid_n * COLS + lanes  # a program owns COLS <= BN columns (see `tile_columns`)
        n_ok = (offs_n < N) & (lanes < COLS)
        if HAS_LORA and EARLY_B:  # lora_B's tiles in flight during the main loop (see `add_lora_with`)
            b0, b1 = lora_b_tiles(lb0_ptr, offs_n, lb1_ptr, offs_n, n_ok, R, R_PAD, PAIR)
        y0, y1, m_ok = base_outputs(x_ptr, stride_xm, offs_m, offs_m < M, w0_ptr, offs_n, w1_ptr, offs_n, n_ok,
                                     b0_ptr, b1_ptr, y0_ptr, y1_ptr, N, K, sp_ptr, cnt_ptr, pid_m * COL_TILES + pid_n,
                                     c // (ROW_BLOCKS * COL_TILES), BM, BN, BK, PAIR, GEMM, HAS_BIAS, EVEN_K,
                                     PRECISION, DOT_F32, OUT, SPLIT)  # fmt: skip
        tile = m_ok[:, None] & n_ok[None, :]  # (nothing in the split programs that do not finish the tile)
        if HAS_LORA:
            if FUSED:
                await_producers(st_ptr, PRODUCED)
            if not EARLY_B:
                b0, b1 = lora_b_tiles(lb0_ptr, offs_n, lb1_ptr, offs_n, n_ok, R, R_PAD, PAIR)
            y0 = add_lora_with(y0, ws_ptr, 0, M, offs_m, m_ok, b0, s0, OUT, R_PAD, ROUND_ADAPTER, PRECISION, FUSED)
            if PAIR:
                y1 = add_lora_with(y1, ws_ptr, 1, M, offs_m, m_ok, b1, s1, OUT, R_PAD, ROUND_ADAPTER, PRECISION,
                                   FUSED)  # fmt: skip
        out = y0
        if PAIR:  # F.silu(gate) * up in eager: silu in fp32 rounded once, then the product rounded
            out = round_to(round_to(y0 / (1.0 + tl.exp(-y0)), OUT) * y1, OUT)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out.to(OUT), mask=tile)
        if NEXT:  # the next projection's lora_A(out), this tile's share of it
            offs_r = tl.arange(0, RN_PAD)
            a = tl.load(an_ptr + offs_r[:, None] * N + offs_n[None, :],
                        mask=(offs_r[:, None] < RN) & n_ok[None, :], other=0.0)  # fmt: skip
            # out cast to the adapter's dtype (peft's cast, as in `shrink_`); the shares meet by atomic adds in the
            # zeroed workspace, in whatever order the programs finish
            part = tl.dot(tl.where(tile, out.to(a.dtype).to(tl.float32), 0.0), tl.trans(a.to(tl.float32)),
                          input_precision=PRECISION)  # fmt: skip
            tl.atomic_add(wsn_ptr + offs_m[:, None] * RN_PAD + offs_r[None, :], part, mask=m_ok[:, None],
                          sem="relaxed")  # fmt: skip
    if FUSED:
        leave(st_ptr, PRODUCED * CHUNKS + ROW_BLOCKS * COL_TILES * SPLIT)


@triton.jit
def _qkv_target(j, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, yq_ptr, yk_ptr, yv_ptr, lbq_ptr, lbk_ptr, lbv_ptr,
                sq, sk, sv, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """What output head j of the q/k/v launch is: (kind 0/1/2 for q/k/v, its head, its tensors and LoRA scale,
    its projection's width)."""
    if j < HQ:
        kind, head, w_ptr, b_ptr, y_ptr, lb_ptr, scale, width = 0, j, wq_ptr, bq_ptr, yq_ptr, lbq_ptr, sq, HQ * D
    elif j < HQ + HK:
        kind, head, w_ptr, b_ptr, y_ptr, lb_ptr, scale, width = 1, j - HQ, wk_ptr, bk_ptr, yk_ptr, lbk_ptr, sk, HK * D
    else:
        kind, head, w_ptr, b_ptr, y_ptr, lb_ptr, scale = 2, j - HQ - HK, wv_ptr, bv_ptr, yv_ptr, lbv_ptr, sv
        width = HK * D
    return kind, head, w_ptr, b_ptr, y_ptr, lb_ptr, scale, width


@triton.jit
def _head_rms_norm(y_lo, y_hi, n_ptr, eps, offs_d, OUT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """Qwen3's RMSNorm over each head (fp32, rounded, then times the weight); the two halves are the whole head."""
    inv = tl.rsqrt((tl.sum(y_lo * y_lo, axis=1) + tl.sum(y_hi * y_hi, axis=1)) / D + eps)[:, None]
    g_lo = tl.load(n_ptr + offs_d).to(tl.float32)[None, :]
    g_hi = tl.load(n_ptr + HALF + offs_d).to(tl.float32)[None, :]
    return round_to(g_lo * round_to(y_lo * inv, OUT), OUT), round_to(g_hi * round_to(y_hi * inv, OUT), OUT)


@triton.jit
def _rope(y_lo, y_hi, cos_ptr, sin_ptr, offs_m, m_ok, offs_d, OUT: tl.constexpr, D: tl.constexpr,
          HALF: tl.constexpr):  # fmt: skip
    """transformers' q * cos + rotate_half(q) * sin on the two halves of a head, each op rounded as in eager."""
    rows = offs_m[:, None] * D
    cos_lo = tl.load(cos_ptr + rows + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + rows + HALF + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + rows + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + rows + HALF + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    r_lo = round_to(round_to(y_lo * cos_lo, OUT) + round_to(-y_hi * sin_lo, OUT), OUT)
    r_hi = round_to(round_to(y_hi * cos_hi, OUT) + round_to(y_lo * sin_hi, OUT), OUT)
    return r_lo, r_hi


# the first programs to arrive compute lora_A(x) for q, k and v when FUSED (`gemm.produce_shrink`; `arrive` gives
# them c < 0), the others one output tile each
@triton.jit
def _qkv_kernel(x_ptr, stride_xm, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, yq_ptr, yk_ptr, yv_ptr, ws_ptr,
                lbq_ptr, lbk_ptr, lbv_ptr, sq, sk, sv, qn_ptr, kn_ptr, eps_q, eps_k, cos_ptr, sin_ptr, q_out_ptr,
                table_ptr, anchor_ptr, layer, col_ptr, cache_len, sp_ptr, cnt_ptr, laq_ptr, lak_ptr, lav_ptr, psp_ptr,
                pcnt_ptr, st_ptr, M, K, R, ROW_BLOCKS, COL_TILES, PRODUCED, CHUNKS, HQ: tl.constexpr, HK: tl.constexpr,
                D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr, GEMM: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, ROUND_ADAPTER: tl.constexpr, QK_NORM: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SLICE: tl.constexpr,
                UNIT: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, PM: tl.constexpr, PK: tl.constexpr,
                SHRINK_PRECISION: tl.constexpr, EARLY_B: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    OUT = q_out_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    PARTS: tl.constexpr = HALF // SLICE  # programs per head: each owns SLICE columns of both RoPE halves
    enter(PDL)
    c = arrive(st_ptr, x_ptr, stride_xm, M, K, laq_ptr, lak_ptr, lav_ptr, ws_ptr, R, psp_ptr, pcnt_ptr, PRODUCED,
               CHUNKS, FUSED, PM, PK, R_PAD, SHRINK_PRECISION)  # fmt: skip
    if c >= 0:  # this program's output tile (row block fastest) and K split
        pid_m = c % ROW_BLOCKS
        j = (c // ROW_BLOCKS) % COL_TILES
        offs_m = pid_m * BM + tl.arange(0, BM)
        part = j % PARTS
        kind, head, w_ptr, b_ptr, y_ptr, lb_ptr, scale, width = _qkv_target(j // PARTS, wq_ptr, wk_ptr, wv_ptr,
            bq_ptr, bk_ptr, bv_ptr, yq_ptr, yk_ptr, yv_ptr, lbq_ptr, lbk_ptr, lbv_ptr, sq, sk, sv, HQ, HK, D)
        offs_d = part * SLICE + tl.arange(0, SLICE)
        lo = head * D + offs_d  # this head's first and second RoPE halves
        hi = lo + HALF
        all_n = offs_d < HALF
        if HAS_LORA and EARLY_B:  # lora_B's tiles in flight during the main loop (see `add_lora_with`)
            b_lo, b_hi = lora_b_tiles(lb_ptr, lo, lb_ptr, hi, all_n, R, R_PAD, True)
        y_lo, y_hi, m_ok = base_outputs(x_ptr, stride_xm, offs_m, offs_m < M, w_ptr, lo, w_ptr, hi, all_n, b_ptr,
                                        b_ptr, y_ptr, y_ptr, width, K, sp_ptr, cnt_ptr, pid_m * COL_TILES + j,
                                        c // (ROW_BLOCKS * COL_TILES), BM, SLICE, BK, True, GEMM, HAS_BIAS, EVEN_K,
                                        PRECISION, DOT_F32, OUT, SPLIT)  # fmt: skip
        if HAS_LORA:
            if FUSED:
                await_producers(st_ptr, PRODUCED)
            if not EARLY_B:
                b_lo, b_hi = lora_b_tiles(lb_ptr, lo, lb_ptr, hi, all_n, R, R_PAD, True)
            y_lo = add_lora_with(y_lo, ws_ptr, kind, M, offs_m, m_ok, b_lo, scale, OUT, R_PAD, ROUND_ADAPTER,
                                 PRECISION, FUSED)  # fmt: skip
            y_hi = add_lora_with(y_hi, ws_ptr, kind, M, offs_m, m_ok, b_hi, scale, OUT, R_PAD, ROUND_ADAPTER,
                                 PRECISION, FUSED)  # fmt: skip
        if kind < 2:
            if QK_NORM:  # SLICE is HALF here: one program holds the whole head
                if kind == 0:
                    y_lo, y_hi = _head_rms_norm(y_lo, y_hi, qn_ptr, eps_q, offs_d, OUT, D, HALF)
                else:
                    y_lo, y_hi = _head_rms_norm(y_lo, y_hi, kn_ptr, eps_k, offs_d, OUT, D, HALF)
            y_lo, y_hi = _rope(y_lo, y_hi, cos_ptr, sin_ptr, offs_m, m_ok, offs_d, OUT, D, HALF)
        if kind == 0:
            base = q_out_ptr + offs_m[:, None] * (HQ * D) + head * D
        else:  # row b's K (or V) at [b, head, column, :] of this layer's [B, HK, cache_len, D] cache
            cache = anchor_ptr + tl.load(table_ptr + 2 * layer + kind - 1) * UNIT
            column = tl.load(col_ptr)
            base = cache + ((offs_m[:, None] * HK + head) * cache_len + column) * D
        tl.store(base + offs_d[None, :], y_lo.to(OUT), mask=m_ok[:, None])
        tl.store(base + HALF + offs_d[None, :], y_hi.to(OUT), mask=m_ok[:, None])
    if FUSED:
        leave(st_ptr, PRODUCED * CHUNKS + ROW_BLOCKS * COL_TILES * SPLIT)


def _producer_args(x: torch.Tensor, lora, fuse, scratch) -> dict:
    """The producer arguments of a launch (`gemm.produce_shrink`): with fuse = (A tensors, state, tf32, K columns
    per producer) and LoRA, the launch computes lora_A(x) into lora's workspace itself; otherwise none."""
    if lora is None or fuse is None:
        return {"a": (x, x, x), "slots": (x, x), "state": x, "tiles": 0, "chunks": 0, "FUSED": False, "PM": 16,
                "SHRINK_PRECISION": "ieee"}  # fmt: skip
    lora_as, state, tf32, chunk = fuse
    (rows, features), r_pad = x.shape, lora[0].shape[-1]
    tiles, chunks = producer_grid(rows, features, len(lora_as), chunk)
    slots = (x, x)
    if chunks > 1:
        slots = scratch.take(x.device, tiles * chunks * producer_rows(rows) * r_pad, tiles, purpose="shrink")
        if slots is None:  # a capture that finds the slots too small: one producer per tile, over all of K
            slots, chunks = (x, x), 1
    return {"a": tuple(lora_as) + (lora_as[0],) * (3 - len(lora_as)), "slots": slots, "state": state,
            "tiles": tiles, "chunks": chunks, "FUSED": True, "PM": producer_rows(rows),
            "SHRINK_PRECISION": "tf32" if tf32 else "ieee"}  # fmt: skip


def can_run_qkv(head_dim: int, dtype: torch.dtype) -> bool:
    """Head dims whose halves tl.dot can tile (32 ... 256, powers of two) in the dtypes it takes."""
    return 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and dtype in (torch.bfloat16, torch.float16,
                                                                                  torch.float32)  # fmt: skip


def qkv_rope_cache(x, weights, biases, outputs, lora, norms, cos, sin, q_out, table, anchor, layer, column, cache_len,
                   heads, kv_heads, head_dim, block_k=64, tf32=True, num_warps=4, num_stages=3,
                   slice_cols=0, block_m=0, split_k=1, scratch=None, fuse=None) -> None:  # fmt: skip
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
    fuse: None, or ((Aq, Ak, Av) [R, K] contiguous, a `SplitScratch.state`, tf32, K columns per producer): the
    launch computes the LoRA workspace itself (`gemm.produce_shrink`, its chunks' slots from `scratch`; the
    workspace need not be zeroed) instead of reading it from `shrink_`.
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
    block_m = rows_per_program(rows, block_m)
    tiles = (triton.cdiv(rows, block_m), (heads + 2 * kv_heads) * (half // slice_cols))
    split, partials, counts = split_args(split_k if gemm else 1, scratch, x, tiles[0] * tiles[1], block_m,
                                          slice_cols, block_k)  # fmt: skip
    fused = _producer_args(x, lora, fuse, scratch)
    _qkv_kernel[(fused["tiles"] * fused["chunks"] + tiles[0] * tiles[1] * split,)](
        x, x.stride(0), *weights_or_x, *b, *y, workspace, *lora_bs, *(float(s) for s in scales), qn, kn,
        float(eps_q), float(eps_k), cos, sin, q_out, table, anchor, layer, column, cache_len, partials, counts,
        *fused["a"], *fused["slots"], fused["state"], rows, features, rank, *tiles, fused["tiles"], fused["chunks"],
        FUSED=fused["FUSED"], PM=fused["PM"], PK=PRODUCER_K, SHRINK_PRECISION=fused["SHRINK_PRECISION"],
        EARLY_B=rows <= EARLY_B_ROWS, HQ=heads, HK=kv_heads, D=head_dim, BM=block_m, BK=block_k, R_PAD=r_pad,
        GEMM=gemm, HAS_BIAS=has_bias, HAS_LORA=lora is not None, ROUND_ADAPTER=round_adapter, QK_NORM=norms is not None,
        EVEN_K=features % block_k == 0, PRECISION=precision(x.dtype, tf32), DOT_F32=interpreting(),
        SLICE=slice_cols, UNIT=table_unit(q_out.dtype), SPLIT=split, num_warps=num_warps,
        num_stages=num_stages, **launch_options(x.device),
    )  # fmt: skip


def project(x, weights, biases, outputs, lora, out, pair: bool, block_n=32, block_k=64, tf32=True, num_warps=4,
            num_stages=3, next_shrink=None, block_m=0, per_sm=0, split_k=1, scratch=None, fuse=None) -> torch.Tensor:
    """out [M, N] = x W0ᵀ + b0 + LoRA0, or with pair=True silu(that) * (x W1ᵀ + b1 + LoRA1).

    weights (W0[, W1]) [N, K] contiguous and biases (or None) for the GEMM, or outputs (y0[, y1]) [M, N] contiguous
    precomputed base outputs; lora None or (workspace [G, M, R_PAD] fp32 from `shrink_`, (B0[, B1]), (s0[, s1])).
    next_shrink: None or (A [R', N] contiguous, a zeroed fp32 workspace [M, R'_PAD]): also compute out · Aᵀ
    there, the LoRA shrink of the projection that reads `out` next, each column tile's share added by fp32 atomics
    (so its last bits vary from run to run: the deterministic engine runs `lora.shrink_(ordered=True)` for it
    instead, which is faster than fixed-point shares from every column tile). block_m: rows per program (0 = up to
    64 by the row count); per_sm: spread the columns over about that many programs per SM (`tile_columns`);
    split_k: programs that share each tile's K (`_split_gemm`; with the kernel's own GEMM and a `SplitScratch`
    only). fuse: None, or ((A0[, A1]) [R, K] contiguous, a `SplitScratch.state`, tf32, K columns per producer): the
    launch computes the LoRA workspace itself (`gemm.produce_shrink`, its chunks' slots from `scratch`; the
    workspace need not be zeroed) instead of reading it from `shrink_`.
    Returns out."""
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
    block_m = rows_per_program(rows, block_m)
    row_blocks = triton.cdiv(rows, block_m)
    cols = tile_columns(width, row_blocks, block_n, per_sm, x.device)
    tiles = (row_blocks, triton.cdiv(width, cols))
    split, partials, counts = split_args(split_k if gemm else 1, scratch, x, tiles[0] * tiles[1], block_m, block_n,
                                          block_k)  # fmt: skip
    fused = _producer_args(x, lora, fuse, scratch)
    _proj_kernel[(fused["tiles"] * fused["chunks"] + tiles[0] * tiles[1] * split,)](
        x, x.stride(0), *two(w), *two(b), *two(y), workspace, *two(lora_bs), *two(scales), out, next_a,
        next_ws, partials, counts, *fused["a"][:2], *fused["slots"], fused["state"], rows, width, features, rank,
        next_rank, cols, *tiles, fused["tiles"], fused["chunks"], FUSED=fused["FUSED"], PM=fused["PM"],
        PK=PRODUCER_K,
        SHRINK_PRECISION=fused["SHRINK_PRECISION"], BM=block_m, BN=block_n,
        BK=block_k, R_PAD=r_pad, PAIR=pair, SPLIT=split, GEMM=gemm, HAS_BIAS=has_bias, HAS_LORA=lora is not None,
        ROUND_ADAPTER=round_adapter,
        EVEN_K=features % block_k == 0, PRECISION=precision(x.dtype, tf32), DOT_F32=interpreting(),
        NEXT=next_shrink is not None, RN_PAD=next_pad, EARLY_B=rows <= EARLY_B_ROWS,
        num_warps=num_warps, num_stages=num_stages, **launch_options(x.device),
    )  # fmt: skip
    return out
