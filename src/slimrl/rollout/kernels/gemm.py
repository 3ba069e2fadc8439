"""The pieces the fused projection kernels share: a skinny GEMM over one or two weight matrices (K split over
several programs when asked, its partial sums added in split order), the base output as transformers rounds it, and
peft's LoRA update as an epilogue. `SplitScratch` holds the split-K partial sums and arrival counts.
Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels.common import add_slots_in_order, pick, round_to


@triton.jit
def gemm_pair(acc0, acc1, x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs_n0, w1_ptr, offs_n1, n_ok, K, k_lo, k_hi,
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
def with_bias(acc, b_ptr, offs_n, n_ok, HAS_BIAS: tl.constexpr, OUT: tl.constexpr):
    """The base projection's output as transformers gets it: fp32 accumulator plus bias, rounded once."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return round_to(acc, OUT)


@triton.jit
def split_gemm(x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, K, sp_ptr, cnt_ptr, tile,
                split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TWO: tl.constexpr,
                EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    """The fp32 products of `gemm_pair` with K split over SPLIT programs (this one the `split`-th of output tile
    `tile`), and whether this program holds them (the last of its tile to finish; the others return partial sums
    and False).

    The partial sums meet in sp (fp32, [tiles, SPLIT, 2, BM, BN]) and cnt (int32 [tiles], zero between launches)
    by `common.add_slots_in_order`: the last to arrive adds them in split order."""
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    k_per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK
    k_lo = split * k_per
    k_hi = tl.minimum(K, k_lo + k_per)
    acc0, acc1 = gemm_pair(acc0, acc1, x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, K, k_lo,
                            k_hi, BK, TWO, EVEN_K, PRECISION, DOT_F32)  # fmt: skip
    last = True
    if SPLIT > 1:
        cells = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        slots = sp_ptr + tile.to(tl.int64) * (SPLIT * 2 * BM * BN)
        acc0, acc1, last = add_slots_in_order(acc0, acc1, slots, cells, split, SPLIT, cnt_ptr, tile, BM * BN, 2,
                                              TWO, True)  # fmt: skip
    return acc0, acc1, last


@triton.jit
def base_outputs(x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, b0_ptr, b1_ptr, y0_ptr,
                  y1_ptr, width, K, sp_ptr, cnt_ptr, tile, split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  TWO: tl.constexpr, GEMM: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                  PRECISION: tl.constexpr, DOT_F32: tl.constexpr, OUT: tl.constexpr,
                  SPLIT: tl.constexpr):  # fmt: skip
    """The base projection's outputs at columns offs0 (and offs1 when TWO), rounded as transformers gets them:
    computed here (GEMM, K split over SPLIT programs, this one the `split`-th of output tile `tile`, see
    `split_gemm`) or loaded from y0/y1 [M, width]
    (computed by cuBLAS or a module); and m_ok narrowed to nothing in the programs that do not finish the tile."""
    if GEMM:
        acc0, acc1, last = split_gemm(x_ptr, stride_xm, offs_m, m_ok, w0_ptr, offs0, w1_ptr, offs1, n_ok, K, sp_ptr,
                                       cnt_ptr, tile, split, BM, BN, BK, TWO, EVEN_K, PRECISION, DOT_F32,
                                       SPLIT)  # fmt: skip
        if SPLIT > 1:  # (m_ok & last in int32: the interpreter's bool & broadcast bool gives no bool mask)
            m_ok = (m_ok.to(tl.int32) & last.to(tl.int32)) != 0
        y0 = with_bias(acc0, b0_ptr, offs0, n_ok, HAS_BIAS, OUT)
        y1 = with_bias(acc1, b1_ptr, offs1, n_ok, HAS_BIAS, OUT)
    else:
        tile = m_ok[:, None] & n_ok[None, :]
        y0 = tl.load(y0_ptr + offs_m[:, None] * width + offs0[None, :], mask=tile, other=0.0).to(tl.float32)
        y1 = y0
        if TWO:
            y1 = tl.load(y1_ptr + offs_m[:, None] * width + offs1[None, :], mask=tile, other=0.0).to(tl.float32)
    return y0, y1, m_ok


@triton.jit
def lora_b_tile(b_ptr, offs_n, n_ok, R, R_PAD: tl.constexpr):
    """lora_B's rows offs_n [BN, R_PAD] (zero past the rank and past the width), in the adapter's dtype."""
    offs_r = tl.arange(0, R_PAD)
    return tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=n_ok[:, None] & (offs_r[None, :] < R), other=0.0)


@triton.jit
def lora_b_tiles(b0_ptr, offs0, b1_ptr, offs1, n_ok, R, R_PAD: tl.constexpr, TWO: tl.constexpr):
    """`lora_b_tile` at columns offs0 of b0 and, when TWO, at offs1 of b1 (else the first tile again): the two
    projections of a pair, or the two RoPE halves of one head."""
    b0 = lora_b_tile(b0_ptr, offs0, n_ok, R, R_PAD)
    b1 = b0
    if TWO:
        b1 = lora_b_tile(b1_ptr, offs1, n_ok, R, R_PAD)
    return b0, b1


@triton.jit
def add_lora(y, ws_ptr, group, M, offs_m, m_ok, b_ptr, offs_n, n_ok, R, scale, OUT: tl.constexpr,
             R_PAD: tl.constexpr, ROUND_ADAPTER: tl.constexpr, PRECISION: tl.constexpr,
             FROM_L2: tl.constexpr = False):  # fmt: skip
    """peft's `result + lora_B(lora_A(x)) * scaling`, rounded to the output dtype; lora_A(x) is the shrink
    workspace [G, M, R_PAD] (fp32), lora_B is [N, R]. FROM_L2: the workspace was written during this launch by
    other programs (`produce_shrink`): read it past L1 (.cg)."""
    b = lora_b_tile(b_ptr, offs_n, n_ok, R, R_PAD)
    return add_lora_with(y, ws_ptr, group, M, offs_m, m_ok, b, scale, OUT, R_PAD, ROUND_ADAPTER, PRECISION, FROM_L2)


@triton.jit
def add_lora_with(y, ws_ptr, group, M, offs_m, m_ok, b, scale, OUT: tl.constexpr, R_PAD: tl.constexpr,
                  ROUND_ADAPTER: tl.constexpr, PRECISION: tl.constexpr, FROM_L2: tl.constexpr):  # fmt: skip
    """`add_lora` with lora_B's tile b [BN, R_PAD] loaded already (`lora_b_tile`): a launch that loads it before its
    main loop has it in registers when the loop ends, instead of waiting on memory then."""
    offs_r = tl.arange(0, R_PAD)
    ws_ptrs = ws_ptr + (group * M + offs_m[:, None]) * R_PAD + offs_r[None, :]
    if FROM_L2:
        xa = tl.load(ws_ptrs, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
    else:
        xa = tl.load(ws_ptrs, mask=m_ok[:, None], other=0.0)
    if ROUND_ADAPTER:  # half-precision adapters: each of peft's steps rounds to the adapter dtype
        xa = round_to(xa, b.dtype)
    delta = tl.dot(xa, tl.trans(b.to(tl.float32)), input_precision=PRECISION)
    if ROUND_ADAPTER:
        delta = round_to(delta, b.dtype)
        delta = round_to(delta * scale, b.dtype)
    else:
        delta = delta * scale
    return round_to(y + delta, OUT)


# -- lora_A(x) inside the projection's own launch ----------------------------------------------------------------------
# A projection launch may compute the LoRA shrink of its input itself instead of reading it from a launch before.
# Its first programs to start (by arrival ticket, not program id: so every one of them is running before any other
# program waits for them) are "producers". The workspace [G, M, R_PAD] is cut into tiles of `producer_rows` rows
# and the whole rank, and each tile's K into SPLITS chunks: a producer computes one chunk's x · A_gᵀ into a slot of
# its own, and the last of a tile's producers to finish adds the slots in chunk order (so the sum is the same on
# every run, in either engine mode), stores the tile and publishes it. The other programs do the GEMM tiles and wait
# only before their LoRA epilogue, until every tile is published. `state` (int32 [4], zero between launches): tickets
# taken, tiles published, programs finished; the last program to finish zeroes it for the next launch.
PRODUCER_K = 64  # K step of a producer's loop


def producer_rows(rows: int) -> int:
    """Rows of one producer tile: small tiles at decode batch sizes, so many programs share the work."""
    return 16 if rows <= 64 else (32 if rows <= 256 else 64)


def producer_grid(rows: int, features: int, group: int, chunk: int) -> tuple[int, int]:
    """(tiles, chunks per tile) of the producers of a launch over x [rows, features] for `group` adapters, each
    producer taking `chunk` columns of K (rounded up to whole K steps)."""
    chunk = triton.cdiv(max(chunk, 1), PRODUCER_K) * PRODUCER_K
    return triton.cdiv(rows, producer_rows(rows)) * group, triton.cdiv(features, chunk)


@triton.jit
def arrive(state_ptr, x_ptr, stride_xm, M, K, a0_ptr, a1_ptr, a2_ptr, ws_ptr, R, sp_ptr, cnt_ptr, TILES, CHUNKS,
           FUSED: tl.constexpr, PM: tl.constexpr, PK: tl.constexpr, R_PAD: tl.constexpr,
           PRECISION: tl.constexpr):  # fmt: skip
    """This program's index among the launch's GEMM programs, or a negative number for a producer, which has done its
    work (`produce_shrink`) when this returns. FUSED: the first TILES * CHUNKS programs to arrive (an arrival ticket)
    are producers; else there are none and the index is the program id."""
    if FUSED:
        t = tl.atomic_add(state_ptr, 1, sem="relaxed", scope="gpu")
        if t < TILES * CHUNKS:
            produce_shrink(t, x_ptr, stride_xm, M, K, a0_ptr, a1_ptr, a2_ptr, ws_ptr, R, sp_ptr, cnt_ptr, state_ptr,
                           CHUNKS, PM, PK, R_PAD, PRECISION)  # fmt: skip
        return t - TILES * CHUNKS
    return tl.program_id(0)


@triton.jit
def produce_shrink(t, x_ptr, stride_xm, M, K, a0_ptr, a1_ptr, a2_ptr, ws_ptr, R, sp_ptr, cnt_ptr, state_ptr,
                   SPLITS, PM: tl.constexpr, PK: tl.constexpr, R_PAD: tl.constexpr,
                   PRECISION: tl.constexpr):  # fmt: skip
    """Producer t: chunk t % SPLITS of K for tile t // SPLITS (adapter g, PM rows) of ws [G, M, R_PAD] = x · A_gᵀ
    (fp32, zero past the rank). x [M, K] with row stride stride_xm; A_g [R, K] contiguous; the input is cast to the
    adapter's dtype first, as peft does (`lora.shrink_` does the same). With SPLITS > 1 the chunks meet in sp
    (fp32 [tiles, SPLITS, PM, R_PAD]) and cnt (int32 [tiles], zero between launches) by
    `common.add_slots_in_order`: the last to arrive adds them in chunk order. The finished tile is published in
    state[1]."""
    tile = t // SPLITS
    split = t % SPLITS
    row_blocks = tl.cdiv(M, PM)
    group = tile // row_blocks
    a_ptr = pick(group, a0_ptr, a1_ptr, a2_ptr)
    rows = tl.arange(0, PM)
    offs_m = (tile % row_blocks) * PM + rows
    offs_r = tl.arange(0, R_PAD)
    offs_k = tl.arange(0, PK)
    m_ok = offs_m[:, None] < M
    r_ok = offs_r[:, None] < R
    chunk = tl.cdiv(tl.cdiv(K, PK), SPLITS) * PK
    k_lo = split * chunk
    acc = tl.zeros((PM, R_PAD), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(K, k_lo + chunk), PK):
        k = k0 + offs_k
        k_ok = k[None, :] < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok & k_ok, other=0.0)
        a = tl.load(a_ptr + offs_r[:, None] * K + k[None, :], mask=r_ok & k_ok, other=0.0)
        x = x.to(a.dtype).to(tl.float32)
        acc = tl.dot(x, tl.trans(a.to(tl.float32)), acc, input_precision=PRECISION)
    done = True
    if SPLITS > 1:
        cells = rows[:, None] * R_PAD + offs_r[None, :]
        slots = sp_ptr + tile.to(tl.int64) * SPLITS * (PM * R_PAD)
        acc, _, done = add_slots_in_order(acc, acc, slots, cells, split, SPLITS, cnt_ptr, tile, PM * R_PAD, 1, False,
                                          False)  # fmt: skip
    if done:
        tl.store(ws_ptr + (group * M + offs_m[:, None]) * R_PAD + offs_r[None, :], acc, mask=m_ok)
        tl.debug_barrier()  # every thread's stores are out before the tile is published
        tl.atomic_add(state_ptr + 1, 1, sem="release", scope="gpu")


@triton.jit
def await_producers(state_ptr, count):
    """Return once `count` producer tiles have been published (their stores then visible to loads past L1)."""
    seen = tl.atomic_add(state_ptr + 1, 0, sem="acquire", scope="gpu")
    while seen < count:
        seen = tl.atomic_add(state_ptr + 1, 0, sem="acquire", scope="gpu")


@triton.jit
def leave(state_ptr, total):
    """Count this program out; the last of the launch's `total` zeroes the state for the next launch."""
    if tl.atomic_add(state_ptr + 2, 1, sem="acq_rel", scope="gpu") == total - 1:
        tl.store(state_ptr, 0)
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr + 2, 0)


class SplitScratch:
    """Partial-sum slots and arrival counts of the split-K launches (`split_gemm`), one pair per device, and the
    counters of launches with producers (`state`).

    A captured graph bakes their addresses in, so they live as long as the owner (the engine's decode session, with
    its graph): they grow outside a capture (the warm-up steps before one see every shape) and are never freed
    while held; a launch that needs more room during a capture runs unsplit instead. The counts are zero between
    launches (each tile's last program resets its own)."""

    def __init__(self):
        self._held: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._outgrown: list = []  # superseded buffers an earlier capture may still read
        self._states: dict[torch.device, torch.Tensor] = {}

    def state(self, device: torch.device) -> torch.Tensor | None:
        """The zeroed int32 [4] counters of launches with producers (`produce_shrink`), or None during a capture
        that finds none made (such a launch then takes its shrink from a launch of its own)."""
        state = self._states.get(device)
        if state is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            state = self._states[device] = torch.zeros(4, dtype=torch.int32, device=device)
        return state

    def holds(self, device: torch.device, purpose: str) -> bool:
        """Whether a launch for `purpose` has taken slots here on `device` ("cuda" matches any CUDA device)."""
        device = torch.device(device)
        return any(held == purpose and on.type == device.type and device.index in (None, on.index)
                   for on, held in self._held)  # fmt: skip

    def take(self, device: torch.device, elements: int, tiles: int,
             purpose: str = "split") -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """(fp32 slots of at least `elements`, zeroed int32 counts of at least `tiles`) for one purpose ("split":
        split-K launches; "shrink": producers' chunks, which run beside split-K programs in the same launch), or
        None during a capture that finds them too small."""
        key = (device, purpose)
        held = self._held.get(key)
        if held is not None and held[0].numel() >= elements and held[1].numel() >= tiles:
            return held
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if held is not None:
            self._outgrown.append(held)
            elements, tiles = max(elements, held[0].numel()), max(tiles, held[1].numel())
        held = (torch.empty(elements, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))  # fmt: skip
        self._held[key] = held
        return held


def split_args(split_k: int, scratch, x: torch.Tensor, tiles: int, block_m: int, block_n: int, block_k: int):
    """(SPLIT, partials, counts) for a launch of `tiles` output tiles: K split into at most split_k even shares of
    whole K steps when a scratch has room, else unsplit (placeholders for the unused pointers)."""
    steps = triton.cdiv(x.shape[1], block_k)
    split = triton.cdiv(steps, triton.cdiv(steps, max(1, min(split_k, steps))))
    if split > 1 and scratch is not None:
        held = scratch.take(x.device, tiles * split * 2 * block_m * block_n, tiles)
        if held is not None:
            return split, held[0], held[1]
    return 1, x, x

