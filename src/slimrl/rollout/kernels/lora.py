"""Grouped LoRA for the decode step: two Triton launches per group of projections that share an input.

A decode step is launch-bound: with peft's default fp32 adapters on a bf16 model, every LoRA projection costs an
input cast, two small fp32 GEMMs (the first split over K, so a reduction kernel too) and an epilogue. Here the
projections that read the same input (q, k and v; gate and up) are handled together, reading the adapter tensors
live from the model:

- `shrink`: `x · A_iᵀ` for up to three adapters in one launch, split over K into many small programs whose fp32
  partial sums meet by atomic adds in a zeroed workspace [G, M, R] (summation order therefore varies run to run
  in the last bits of fp32), or, `ordered`, so that the result depends only on the inputs: K split in two at most,
  the two shares added into zero by fp32 atomics (which commute), where small tiles give programs enough; else, at
  decode steps of 65 to 256 rows, each split's fp32 partial stored in a slot of its own and the slots added in split
  order by the last program of each tile to arrive; else as fixed-point integers (`common.fixed_add`: each partial
  truncated to a multiple of 2**-32, then int64 atomics, whose sum is the same in any order), converted to fp32 by
  the last program of each tile to arrive;
- `expand`: per output tile, `(x · A_iᵀ) · B_iᵀ · scale_i`, added in place into the projection's output.

The arithmetic follows peft's `Linear.forward` (input cast to the adapter dtype, `result + lora_B(lora_A(x)) *
scaling` with the adapter dtype's roundings, the sum rounded once to the output dtype); only summation order differs.
fp32 products use TF32 when `tf32` is set. `model.reference.add_lora_` is the plain-PyTorch version, and the tests
compare the two on CUDA. Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels import runs_here
from slimrl.rollout.kernels.common import (
    add_slots_in_order,
    enter,
    fixed_add,
    fixed_limit,
    fixed_load,
    last_to_arrive,
    pick,
)
from slimrl.rollout.kernels.common import options as launch_options
from slimrl.rollout.model.reference import add_lora_

MAX_GROUP = 3  # adapters per launch (q, k, v)
TARGET_PROGRAMS = 512  # shrink programs to aim for (about four per SM of an H100)
# with fixed-point sums: int64 atomics have no vector form (fp32 ones go four at a time), so fewer K splits pay,
# in smaller tiles (rows, rank columns; at most these) than the atomic path's, for as many programs with fewer
# splits (bench/shrink_splits.py: W1's four shrinks at 64 and 256 rows are fastest together with these)
TARGET_PROGRAMS_FIXED = 256
FIXED_TILE = (32, 16)
# over more than 64 and up to 256 rows (the H100's 256-row decode bucket, whose launches do not compute their own
# shrink), the K splits store their fp32 partial sums in slots of their own (plain stores into an unzeroed scratch,
# `slot_elements`) and the last of a tile's splits to arrive adds them in split order, in the pair's tiles and program
# count: W1's deterministic 256-row step took 4.994 against 5.313 ms in fixed point; at 8 rows fixed point stayed
# faster (2.339 against 2.520), so it keeps the other row counts (docs/bench/issue34/ordered_slots_ab.json)
SLOT_ROWS = (64, 256)
# up to this many input features an ordered shrink may split K in two at most and add the two shares by fp32
# atomics into zero: 0 + a + b and 0 + b + a are the same float (addition commutes), so no fixed point is needed;
# its programs then come from small tiles, and it does so where those give at least PAIR_MIN_PROGRAMS programs (the
# adapters' weights are read from memory by fewer programs otherwise: W1's step at 64 rows is faster in fixed point)
PAIR_MAX_FEATURES = 2048
PAIR_TILE = (16, 32)
PAIR_MIN_PROGRAMS = 128
WORKSPACE_BYTES = 64 << 20  # largest per-forward LoRA workspace; beyond it each call zeroes its own


def can_fuse(x: torch.Tensor, items) -> bool:
    """Whether `lora_group_` handles these: CUDA, contiguous, one adapter dtype and rank, at most three."""
    if not items or len(items) > MAX_GROUP or not runs_here(x) or x.dim() != 2 or x.stride(-1) != 1:
        return False
    lora_a0, lora_b0, _ = items[0][1]
    rank, dtype = lora_a0.shape[0], lora_a0.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or rank > 128:
        return False
    for y, (lora_a, lora_b, _) in items:
        if lora_a.dtype != dtype or lora_b.dtype != dtype or lora_a.shape != (rank, x.shape[1]):
            return False
        if lora_b.shape != (y.shape[1], rank) or not (lora_a.is_contiguous() and lora_b.is_contiguous()):
            return False
        if y.shape[0] != x.shape[0] or not y.is_contiguous() or y.dtype != items[0][0].dtype:
            return False
    return True


def _mode(rows: int, features: int, group: int, r_pad: int, ordered: bool) -> str:
    """How a shrink's K splits meet: "atomic" (fp32, any order), "pair" (at most two, fp32), "slots" (in split order)
    or "fixed" (fixed point)."""
    if not ordered:
        return "atomic"
    block_m, block_r = _tiling(rows, r_pad, "pair")
    programs = triton.cdiv(rows, block_m) * group * (r_pad // block_r) * 2
    if features <= PAIR_MAX_FEATURES and programs >= PAIR_MIN_PROGRAMS:
        return "pair"
    return _ordered_sums(rows)


def _ordered_sums(rows: int) -> str:
    """How an ordered shrink over `rows` rows adds more than two K splits: "slots" or "fixed" (see SLOT_ROWS)."""
    return "slots" if SLOT_ROWS[0] < rows <= SLOT_ROWS[1] else "fixed"


def _tiling(rows: int, r_pad: int, mode: str) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_R) of a shrink over `rows` rows at padded rank r_pad."""
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else (64 if rows <= 256 else 128))
    # a prefill has rows enough for parallelism: one rank block, so x is read once per adapter, and 128 rows a
    # program, so each adapter's lora_A is read by half as many programs as at 64 (at 16,384 rows down's shrink
    # took 106 us against 176 at 64: docs/bench/issue34/explore_prefill_shrink_h200.json)
    block_r = r_pad if rows > 256 and r_pad <= 64 else min(r_pad, 32)
    if mode != "atomic" and rows <= 256:  # a decode step: programs from smaller tiles rather than more K splits
        tile = FIXED_TILE if mode == "fixed" else PAIR_TILE
        return min(block_m, tile[0]), min(block_r, tile[1])
    return block_m, block_r


def workspace_elements(group: int, rows: int, rank: int, ordered: bool) -> int:
    """fp32 elements of the zeroed workspace a shrink of `group` adapters over `rows` rows needs: its result
    [G, M, R_PAD], and when ordered the tiles' arrival counts, after the int64 fixed-point sums and the poison [G, M]
    where the rows take fixed point (an even count, so that the next piece of a shared workspace stays 8-byte
    aligned). Room for either whatever the input width: the same workspace serves every shrink of a step (the slots
    of `slot_elements` live apart, unzeroed)."""
    r_pad = padded_rank(rank)
    cells = group * rows * r_pad
    if not ordered:
        return cells
    sums = _ordered_sums(rows)
    block_m, block_r = _tiling(rows, r_pad, sums)
    tiles = triton.cdiv(rows, block_m) * group * (r_pad // block_r)
    total = (3 * cells + group * rows if sums == "fixed" else cells) + tiles
    return total + total % 2


def _splits(features: int, programs_per_split: int, target: int) -> int:
    """K splits of a shrink: until there are about `target` programs (a decode step has few rows, so K is the
    parallel dimension), in whole K steps of 64."""
    splits = max(1, min(triton.cdiv(features, 64), triton.cdiv(target, programs_per_split)))
    return triton.cdiv(features, triton.cdiv(triton.cdiv(features, splits), 64) * 64)


def slot_elements(rows: int, rank: int) -> int:
    """fp32 elements of the slot scratch any ordered shrink over `rows` rows may need: its K splits' partial sums
    (none where its splits meet otherwise). Unzeroed: every slot a launch reads it has written first, so one scratch
    serves every shrink of a forward, one launch after another."""
    if _ordered_sums(rows) != "slots":
        return 0
    r_pad = padded_rank(rank)
    block_m, block_r = _tiling(rows, r_pad, "slots")
    tiles = [triton.cdiv(rows, block_m) * group * (r_pad // block_r) for group in range(1, MAX_GROUP + 1)]
    return max(t * _splits(1 << 30, t, TARGET_PROGRAMS) * block_m * block_r for t in tiles)


@triton.jit
def _shrink_kernel(x_ptr, a0_ptr, a1_ptr, a2_ptr, ws_ptr, sum_ptr, pz_ptr, cnt_ptr, M, K, R, stride_xm, k_per_split,
                   limit,
                   R_BLOCKS: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, FIXED: tl.constexpr, SLOTS: tl.constexpr,
                   PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    pid_m = tl.program_id(0)
    group = tl.program_id(1) // R_BLOCKS
    r_block = tl.program_id(1) % R_BLOCKS
    split = tl.program_id(2)
    a_ptr = pick(group, a0_ptr, a1_ptr, a2_ptr)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    r_ok = offs_r[:, None] < R
    k_start = split * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_start + k0 + offs_k
        k_ok = k[None, :] < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok & k_ok, other=0.0)
        a = tl.load(a_ptr + offs_r[:, None] * K + k[None, :], mask=r_ok & k_ok, other=0.0)
        x = x.to(a.dtype).to(tl.float32)  # peft casts the input to the adapter's dtype
        acc += tl.dot(x, tl.trans(a.to(tl.float32)), input_precision=PRECISION)
    # the K splits of one (rows, rank) tile meet here
    cells = (group * M + offs_m[:, None]) * R_PAD + offs_r[None, :]
    if FIXED:  # as fixed point (the same bits in any order); the last split to arrive writes the fp32 values
        poison = pz_ptr + group * M + offs_m
        fixed_add(sum_ptr + cells, poison, acc, offs_m < M, m_ok, limit)
        tile = pid_m * tl.num_programs(1) + tl.program_id(1)
        if last_to_arrive(cnt_ptr, tile, tl.num_programs(2)):
            tl.store(ws_ptr + cells, fixed_load(sum_ptr + cells, poison, offs_m < M, m_ok), mask=m_ok)
    elif SLOTS:  # each split's partial in a slot of its own; the tile's last split to arrive adds them in order
        tile = pid_m * tl.num_programs(1) + tl.program_id(1)
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
        slots = sum_ptr + (tile * tl.num_programs(2)).to(tl.int64) * (BLOCK_M * BLOCK_R)
        total, _, last = add_slots_in_order(acc, acc, slots, local, split, tl.num_programs(2), cnt_ptr, tile,
                                            BLOCK_M * BLOCK_R, 1, False, False)  # fmt: skip
        if last:
            tl.store(ws_ptr + cells, total, mask=m_ok)
    else:  # by fp32 atomics in the zeroed workspace, in whatever order the programs finish
        tl.atomic_add(ws_ptr + cells, acc, mask=m_ok & (offs_r[None, :] < R_PAD), sem="relaxed")


@triton.jit
def _expand_kernel(ws_ptr, b0_ptr, b1_ptr, b2_ptr, y0_ptr, y1_ptr, y2_ptr, n0, n1, n2, s0, s1, s2, M, R,
                   tiles0, tiles1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                   ROUND_ADAPTER: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # which projection this output tile belongs to
    past0 = (pid_n >= tiles0).to(tl.int32)
    past1 = (pid_n >= tiles0 + tiles1).to(tl.int32)
    group = past0 + past1
    tile = pid_n - past0 * tiles0 - past1 * tiles1
    if pid_n < tiles0:
        b_ptr = b0_ptr
        y_ptr = y0_ptr
        n = n0
        scale = s0
    elif pid_n < tiles0 + tiles1:
        b_ptr = b1_ptr
        y_ptr = y1_ptr
        n = n1
        scale = s1
    else:
        b_ptr = b2_ptr
        y_ptr = y2_ptr
        n = n2
        scale = s2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R_PAD)
    m_ok = offs_m[:, None] < M
    xa = tl.load(ws_ptr + (group * M + offs_m[:, None]) * R_PAD + offs_r[None, :], mask=m_ok, other=0.0)
    b_ok = (offs_n[:, None] < n) & (offs_r[None, :] < R)
    b = tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=b_ok, other=0.0)  # zeros past the rank
    if ROUND_ADAPTER:  # half-precision adapters: lora_A's output is rounded to their dtype, as in peft
        xa = xa.to(b.dtype).to(tl.float32)
    acc = tl.dot(xa, tl.trans(b.to(tl.float32)), input_precision=PRECISION)
    if ROUND_ADAPTER:
        acc = acc.to(b.dtype).to(tl.float32)
        acc = (acc * scale).to(b.dtype).to(tl.float32)
    else:
        acc = acc * scale
    mask = m_ok & (offs_n[None, :] < n)
    y_ptrs = y_ptr + offs_m[:, None] * n + offs_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (n - 1).bit_length())


def padded_rank(rank: int) -> int:
    return _pow2_at_least(rank, 16)


def shrink_(x: torch.Tensor, lora_as, workspace: torch.Tensor | None = None, tf32: bool = True,
            ordered: bool = False, slots: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """lora_A(x) for up to three adapters at once: returns the fp32 [G, M, R_PAD] holding x · A_iᵀ (zero past the
    rank). workspace: a flat zeroed fp32 tensor of at least `workspace_elements(G, M, r, ordered)` elements, or
    None. slots: unzeroed fp32 scratch of at least `slot_elements(M, r)` elements for an ordered shrink's split
    sums, or None (made here when needed). The launch takes no host sync.

    ordered: the result depends only on the inputs. Up to PAIR_MAX_FEATURES input features and with rows enough
    (PAIR_MIN_PROGRAMS), K is split in two at most and the shares meet by fp32 atomics into zero (two terms add
    the same in either order). Otherwise, over SLOT_ROWS, each K split stores its fp32 partial sums in a slot of its
    own and the last split of a tile to arrive adds them in split order (fp32, from zero: NaN and infinities carry
    as in any float sum); else the partial sums meet as fixed point (`common.fixed_add`): the result is the exact
    sum of the partials truncated to multiples of 2**-32, rounded once to fp32, and NaN in a row where a partial was
    not finite or too large to hold (`common.fixed_limit`)."""
    rows, features = x.shape
    group = len(lora_as)
    rank = lora_as[0].shape[0]
    r_pad = padded_rank(rank)
    if workspace is None:
        workspace = torch.zeros(workspace_elements(group, rows, rank, ordered), dtype=torch.float32, device=x.device)
    cells = group * rows * r_pad
    values = workspace[:cells]
    mode = _mode(rows, features, group, r_pad, ordered)
    precision = "tf32" if tf32 else "ieee"
    block_m, block_r = _tiling(rows, r_pad, mode)
    r_blocks = r_pad // block_r
    block_k = 64
    m_tiles = triton.cdiv(rows, block_m)
    target = TARGET_PROGRAMS_FIXED if mode == "fixed" else TARGET_PROGRAMS
    splits = _splits(features, m_tiles * group * r_blocks, target)
    if mode == "pair" and splits > 2:
        splits = _splits(features, 1, 2)
    k_per_split = triton.cdiv(triton.cdiv(features, splits), block_k) * block_k
    splits = triton.cdiv(features, k_per_split)
    if mode == "slots" and splits <= 2:  # two shares at most: added into zero by fp32 atomics, in either order
        mode = "pair"
    sums = poison = counts = values  # placeholders for the pointers an atomic launch does not use
    if mode == "fixed":
        sums = workspace[cells : 3 * cells].view(torch.int64)
        poison = workspace[3 * cells : 3 * cells + group * rows]
        counts = workspace[3 * cells + group * rows :].view(torch.int32)
    elif mode == "slots":
        counts = workspace[cells:].view(torch.int32)
        needed = m_tiles * group * r_blocks * splits * block_m * block_r
        if slots is None or slots.numel() < needed:
            slots = torch.empty(needed, dtype=torch.float32, device=x.device)
        sums = slots
    a_args = list(lora_as) + [lora_as[0]] * (MAX_GROUP - group)
    _shrink_kernel[(m_tiles, group * r_blocks, splits)](
        x, *a_args, values, sums, poison, counts, rows, features, rank, x.stride(0), k_per_split, fixed_limit(splits),
        R_BLOCKS=r_blocks, R_PAD=r_pad, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, PRECISION=precision,
        FIXED=mode == "fixed", SLOTS=mode == "slots", **launch_options(x.device),
    )  # fmt: skip
    return values.view(group, rows, r_pad)


def lora_group_(x: torch.Tensor, items, tf32: bool = True, workspace: torch.Tensor | None = None,
                ordered: bool = False, slots: torch.Tensor | None = None) -> None:  # fmt: skip
    """In place: y_i += B_i(A_i(x)) * scale_i for each (y_i, (A_i, B_i, scale_i)) in items (see `can_fuse`).

    x [M, K]; y_i [M, n_i] contiguous. workspace: flat zeroed fp32 of at least `workspace_elements` (allocated here
    when None). ordered: deterministic shrink (`shrink_`). Three launches at most (zeroing, shrink, expand); no
    host sync.
    """
    rows = x.shape[0]
    group = len(items)
    lora_bs = [b for _, (_, b, _) in items]
    outputs = [y for y, _ in items]
    scales = [float(s) for _, (_, _, s) in items]
    rank = lora_bs[0].shape[1]
    r_pad = padded_rank(rank)
    workspace = shrink_(x, [a for _, (a, _, _) in items], workspace, tf32, ordered, slots)
    precision = "tf32" if tf32 else "ieee"
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    m_tiles = triton.cdiv(rows, block_m)
    pad = MAX_GROUP - group
    widths = [y.shape[1] for y in outputs]
    block_n = 128 if sum(widths) * m_tiles >= 128 * 128 else 64
    tiles = [triton.cdiv(w, block_n) for w in widths] + [0] * pad
    b_args = lora_bs + [lora_bs[0]] * pad
    y_args = outputs + [outputs[0]] * pad
    n_args = widths + [widths[0]] * pad
    s_args = scales + [scales[0]] * pad
    round_adapter = lora_bs[0].dtype != torch.float32
    _expand_kernel[(m_tiles, sum(tiles))](
        workspace, *b_args, *y_args, *n_args, *s_args, rows, rank, tiles[0], tiles[1],
        BLOCK_M=block_m, BLOCK_N=block_n, R_PAD=r_pad, ROUND_ADAPTER=round_adapter, PRECISION=precision,
        **launch_options(x.device),
    )  # fmt: skip


class GroupedLoRA:
    """`add_lora(x, items)` for `Decoder.forward_grouped`: Triton where it applies, peft's math elsewhere.

    `begin(rows, calls, rank)` at the start of a forward zeroes one workspace for all of its calls (one memset per
    decode step instead of one per projection group); calls past it, or of a larger rank, allocate their own.
    ordered: deterministic shrinks (`shrink_(ordered=True)`).
    """

    def __init__(self, tf32: bool = True, ordered: bool = False):
        self.tf32 = tf32
        self.ordered = ordered
        self._workspace = None
        self._slots = None
        self._offset = 0
        self._r_pad = 0

    def begin(self, rows: int, calls: int, rank: int, device: torch.device) -> None:
        self._r_pad = padded_rank(max(rank, 1))
        size = calls * workspace_elements(MAX_GROUP, rows, self._r_pad, self.ordered)
        self._offset = 0
        slot_size = slot_elements(rows, self._r_pad) if self.ordered else 0
        self._slots = torch.empty(slot_size, dtype=torch.float32, device=device) if slot_size else None
        if size * 4 > WORKSPACE_BYTES:  # a long prefill: per-call buffers are smaller
            self._workspace = None
            return
        self._workspace = torch.zeros(size, dtype=torch.float32, device=device)

    @property
    def slots(self) -> torch.Tensor | None:
        """The forward's slot scratch (`slot_elements` at its rows), or None: `shrink_` then makes its own."""
        return self._slots

    def take(self, elements: int, rank: int) -> torch.Tensor | None:
        """The next `elements` of the zeroed per-forward workspace, or None when it has no room (or another rank)."""
        if self._workspace is None or padded_rank(rank) != self._r_pad:
            return None
        if self._offset + elements > self._workspace.numel():
            return None
        piece = self._workspace[self._offset : self._offset + elements]
        self._offset += elements
        return piece

    def __call__(self, x: torch.Tensor, items) -> None:
        for start in range(0, len(items), MAX_GROUP):
            chunk = items[start : start + MAX_GROUP]
            if not can_fuse(x, chunk):
                add_lora_(x, chunk)
                continue
            rank = chunk[0][1][0].shape[0]
            workspace = self.take(workspace_elements(len(chunk), x.shape[0], rank, self.ordered), rank)
            lora_group_(x, chunk, self.tf32, workspace, self.ordered, self._slots)
