"""The decode step's sparse MLP (Qwen3-MoE, Mixtral) as five Triton launches that read each routed expert's weights
once: no per-expert launches, no sort on the host, nothing that syncs with it (a captured graph replays them).

At decode a batch of B tokens routes B * k (token, expert) pairs over E experts, a handful per expert: torch's
grouped GEMMs there cost about 1.7x the time of reading the weights (docs/benchmarks.md, Qwen3-30B-A3B's shape).
Here every program owns one row block of one expert and a tile of output columns, so an expert's weight tile is
read by one program (two or more only for an expert with more routed rows than a block holds):

1. `_layout_kernel` (a program per expert): the routed pairs sorted by expert, stably (pair order within an
   expert), each expert's rows padded to whole blocks of BM; which expert each block belongs to (-1: unused; the
   grid is sized for the most blocks any routing can need, `max_blocks`, so that it does not depend on the routing).
2. `_shrink_kernel`: LoRA's first product x A_eᵀ of each block's rows, fp32, into a workspace [slots, R_PAD]. A
   launch of its own rather than recomputed in each column tile of the next kernel: Qwen3-30B-A3B's gate/up rank
   is 128 over 2048 inputs, which twelve column tiles would each read again.
3. `_gate_up_kernel`: x W_guᵀ and the LoRA epilogue for a tile of gate columns and the matching up columns (x read
   once for both), then silu(gate) * up -> act [slots, I].
4. `_shrink_kernel` again, over act and the down projection's A (act is whole only after step 3).
5. `_down_kernel`: act W_dᵀ + LoRA, times the pair's routing weight, then added into the token's fp32 output row
   by atomics, or, `ordered` (the engine's deterministic mode), stored as the pair's own row, the top-k rows then
   summed by torch in pair order, exactly as the reference sums them.

Rounding follows `model.moe.expert_mix` (the reference): each GEMM's output rounded to the weight dtype, LoRA as
peft adds it with factors in the weight dtype, SiLU and the product rounded as eager does, the weighted product in
the dtype torch promotes to. Only summation order differs. Launch settings: `MoELaunch` (bench/tune_moe.py).
Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels import interpreting, runs_here
from slimrl.rollout.kernels.common import enter, precision, round_to
from slimrl.rollout.kernels.common import options as launch_options
from slimrl.rollout.kernels.gemm import add_lora, gemm_pair

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_RANK = 256  # the LoRA epilogue holds a [BM, R_PAD] tile of the shrink per program


@dataclass(frozen=True)
class MoELaunch:
    """Launch settings: rows per block (0: by the mean rows per expert, `block_rows`), output columns per program
    (gate/up: of each of the pair), K step, rank columns per shrink program, warps and pipeline stages. The
    defaults are bench/tune_moe.py's fastest at Qwen3-30B-A3B's layer and 64 tokens on an H100, atomic and ordered
    (docs/bench/issue33/tune_moe_*.json: 0.488 ms a layer against 0.503 ms with the first, untuned ones)."""

    block_m: int = 0
    block_n: int = 32
    block_k: int = 128
    block_r: int = 128
    num_warps: int = 4
    num_stages: int = 3


class Layout(NamedTuple):
    """Routed pairs grouped by expert: slot s of the padded order holds pair rows[s] (token * k + j; -1 padding);
    block b (slots b*BM ... b*BM + BM - 1) belongs to expert block_experts[b] (-1: unused)."""

    rows: torch.Tensor  # int32 [blocks * BM]
    block_experts: torch.Tensor  # int32 [blocks]
    block_m: int


def block_rows(pairs: int, experts: int) -> int:
    """Rows per block: the smallest of 16, 32, 64 that holds twice the mean rows an expert gets, so that most
    experts fit one block (a second block reads the expert's weights again)."""
    mean = pairs / experts
    return 16 if mean <= 8 else (32 if mean <= 16 else 64)


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The most blocks a routing of `pairs` over `experts` can need: each used expert's ceil(rows / BM) is at most
    1 + floor(rows / BM), and at most min(experts, pairs) experts are used."""
    return min(experts, pairs) + pairs // block_m


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


@triton.jit
def _layout_kernel(experts_ptr, rows_ptr, block_experts_ptr, zero_ptr, ZEROS, S, BLOCKS, BM: tl.constexpr,
                   E_PAD: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """`routed_layout`, program e placing expert e's pairs. Every program counts all experts' pairs (a histogram
    of the ids, CHUNK at a time), so it knows where expert e's blocks begin (a scan of the experts' block counts)
    without waiting for another program; it then writes its blocks' owner, its pairs at their slots in pair order
    (stable: a scan of "this pair is e's" over the pairs) and -1 in the rest of its last block. Program 0 also
    marks the blocks no expert uses (owner -1, slots -1, FILL slots a store). Nothing here depends on another
    program's writes: no ordering between programs is needed. (One program doing all experts in sequence took 26
    us a layer on an H100 at Qwen3-30B-A3B's 64 tokens x 8 of 128 experts; 5% of the sparse block.) The programs
    also zero the ZEROS fp32 values at zero_ptr (the down kernel's accumulator, an fp32 fill launch otherwise)."""
    enter(PDL)
    me = tl.program_id(0)
    fill = tl.arange(0, FILL)
    share = tl.cdiv(ZEROS, tl.num_programs(0))
    for start in range(me * share, tl.minimum(ZEROS, me * share + share), FILL):
        tl.store(zero_ptr + start + fill, tl.zeros([FILL], tl.float32), mask=start + fill < ZEROS)
    ids = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)  # routed pairs per expert
    for start in range(0, S, CHUNK):
        valid = start + lanes < S
        expert = tl.load(experts_ptr + start + lanes, mask=valid, other=0).to(tl.int32)
        # lanes past S read expert 0: take them back out of bin 0
        missing = tl.sum((valid == 0).to(tl.int32), axis=0)
        counts += tl.histogram(expert, E_PAD) - tl.where(ids == 0, missing, 0)
    blocks = (counts + BM - 1) // BM
    ends = tl.cumsum(blocks, axis=0)  # each expert's blocks end here
    mine = ids == me
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    own_blocks = tl.sum(tl.where(mine, blocks, 0), axis=0)
    first_block = tl.sum(tl.where(mine, ends, 0), axis=0) - own_blocks
    first = first_block * BM  # this expert's first slot
    owner = tl.full([CHUNK], 0, tl.int32) + me
    for b in range(0, own_blocks, CHUNK):
        tl.store(block_experts_ptr + first_block + b + lanes, owner, mask=b + lanes < own_blocks)
    seen = tl.full([], 0, tl.int32)  # this expert's pairs placed so far
    for start in range(0, S, CHUNK):
        pair = start + lanes
        hit = (tl.load(experts_ptr + pair, mask=pair < S, other=-1).to(tl.int32) == me).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - hit
        tl.store(rows_ptr + first + rank, pair, mask=hit > 0)
        seen += tl.sum(hit, axis=0)
    pad = tl.arange(0, BM)
    tl.store(rows_ptr + first + count + pad, tl.full([BM], -1, tl.int32), mask=pad < own_blocks * BM - count)
    if me == 0:
        used = tl.sum(blocks, axis=0)
        for b in range(used, BLOCKS, CHUNK):
            tl.store(block_experts_ptr + b + lanes, tl.full([CHUNK], -1, tl.int32), mask=b + lanes < BLOCKS)
        for start in range(used * BM, BLOCKS * BM, FILL):
            tl.store(rows_ptr + start + fill, tl.full([FILL], -1, tl.int32), mask=start + fill < BLOCKS * BM)


def routed_layout(experts: torch.Tensor, num_experts: int, block_m: int, zero: torch.Tensor | None = None) -> Layout:
    """The pairs of experts [N, k] (expert ids, any integer dtype) grouped by expert, on the device, in one launch
    of one program per expert; `zero` (contiguous fp32), if given, is zeroed by the same launch."""
    pairs = experts.numel()
    blocks = max_blocks(pairs, num_experts, block_m)
    rows = torch.empty(blocks * block_m, dtype=torch.int32, device=experts.device)
    block_experts = torch.empty(blocks, dtype=torch.int32, device=experts.device)
    # chunks of at least one id per thread of the 4 warps, at most 1,024 ids (a decode step's 64 x 8 take one)
    _layout_kernel[(num_experts,)](
        experts.reshape(-1).contiguous(), rows, block_experts, rows if zero is None else zero,
        0 if zero is None else zero.numel(), pairs, blocks, BM=block_m, E_PAD=_pow2(num_experts),
        CHUNK=min(1024, _pow2(pairs, 128)), FILL=1024, num_warps=4, **launch_options(experts.device),
    )  # fmt: skip
    return Layout(rows, block_experts, block_m)


@triton.jit
def _block(rows_ptr, block_experts_ptr, BM: tl.constexpr):
    """(expert or -1, slots [BM], pairs [BM] (0 for padding), live [BM]) of this program's row block."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    slots = block * BM + tl.arange(0, BM)
    pairs = tl.load(rows_ptr + slots)
    live = pairs >= 0
    return expert, slots, tl.where(live, pairs, 0), live


@triton.jit
def _shrink_kernel(x_ptr, stride_xm, a_ptr, ws_ptr, rows_ptr, block_experts_ptr, K, R, TOP_K, GATHER: tl.constexpr,
                   BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """ws[slot, r] = x[row] · A_e[r] for rank columns r of this program (zero past R); x's row is the pair's token
    (GATHER: x is the layer input [N, K]) or the slot itself (x is act [slots, K])."""
    enter(PDL)
    expert, slots, pairs, live = _block(rows_ptr, block_experts_ptr, BM)
    if expert < 0:
        return
    offs_m = pairs // TOP_K if GATHER else slots
    offs_r = tl.program_id(1) * BR + tl.arange(0, BR)
    a = a_ptr + expert.to(tl.int64) * R * K
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    acc, _ = gemm_pair(acc, acc, x_ptr, stride_xm, offs_m, live, a, offs_r, a, offs_r, offs_r < R, K, 0, K, BK,
                       False, EVEN_K, PRECISION, DOT_F32)  # fmt: skip
    tl.store(ws_ptr + slots[:, None] * R_PAD + offs_r[None, :], acc)


@triton.jit
def _gate_up_kernel(x_ptr, stride_xm, w_ptr, ws_ptr, b_ptr, scale, act_ptr, rows_ptr, block_experts_ptr, K, INNER,
                    R, TOP_K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr,
                    HAS_LORA: tl.constexpr, ROUND_ADAPTER: tl.constexpr, EVEN_K: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """act[slot, cols] = silu(gate) * up of this block's rows, gate and up with their LoRA; W_gu [E, 2I, K] holds
    gate in rows 0..I-1 and up in rows I..2I-1, as transformers' experts chunk it (INNER is I)."""
    OUT = act_ptr.dtype.element_ty
    enter(PDL)
    expert, slots, pairs, live = _block(rows_ptr, block_experts_ptr, BM)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = cols < INNER
    w = w_ptr + e * (2 * INNER) * K
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    gate, up = gemm_pair(gate, up, x_ptr, stride_xm, pairs // TOP_K, live, w, cols, w, INNER + cols, n_ok, K, 0, K,
                         BK, True, EVEN_K, PRECISION, DOT_F32)  # fmt: skip
    gate, up = round_to(gate, OUT), round_to(up, OUT)
    if HAS_LORA:
        b = b_ptr + e * (2 * INNER) * R
        gate = add_lora(gate, ws_ptr, 0, 0, slots, live, b, cols, n_ok, R, scale, OUT, R_PAD, ROUND_ADAPTER,
                        PRECISION)  # fmt: skip
        up = add_lora(up, ws_ptr, 0, 0, slots, live, b, INNER + cols, n_ok, R, scale, OUT, R_PAD, ROUND_ADAPTER,
                      PRECISION)  # fmt: skip
    act = round_to(round_to(gate / (1.0 + tl.exp(-gate)), OUT) * up, OUT)  # F.silu(gate) * up in eager
    tl.store(act_ptr + slots[:, None] * INNER + cols[None, :], act.to(OUT), mask=live[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, ws_ptr, b_ptr, scale, weights_ptr, out_ptr, rows_ptr, block_experts_ptr, INNER, H,
                 R, TOP_K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, R_PAD: tl.constexpr,
                 HAS_LORA: tl.constexpr, ROUND_ADAPTER: tl.constexpr, ROUND_WEIGHTED: tl.constexpr,
                 ORDERED: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
                 PDL: tl.constexpr):  # fmt: skip
    """(act W_dᵀ + LoRA) * routing weight of this block's rows: stored at the pair's row of out [N*k, H]
    (ORDERED) or added into its token's row of the fp32 out [N, H]."""
    OUT = w_ptr.dtype.element_ty
    enter(PDL)
    expert, slots, pairs, live = _block(rows_ptr, block_experts_ptr, BM)
    if expert < 0:
        return
    e = expert.to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = cols < H
    w = w_ptr + e * H * INNER
    y = tl.zeros((BM, BN), dtype=tl.float32)
    y, _ = gemm_pair(y, y, act_ptr, INNER, slots, live, w, cols, w, cols, n_ok, INNER, 0, INNER, BK, False, EVEN_K,
                     PRECISION, DOT_F32)  # fmt: skip
    y = round_to(y, OUT)
    if HAS_LORA:
        y = add_lora(y, ws_ptr, 0, 0, slots, live, b_ptr + e * H * R, cols, n_ok, R, scale, OUT, R_PAD,
                     ROUND_ADAPTER, PRECISION)  # fmt: skip
    weighted = y * tl.load(weights_ptr + pairs, mask=live, other=0.0).to(tl.float32)[:, None]
    if ROUND_WEIGHTED:  # weight and routing weight of one half dtype: torch's product is in that dtype
        weighted = round_to(weighted, OUT)
    mask = live[:, None] & n_ok[None, :]
    if ORDERED:
        tl.store(out_ptr + pairs[:, None] * H + cols[None, :], weighted.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + (pairs // TOP_K)[:, None] * H + cols[None, :], weighted, mask=mask, sem="relaxed")


# -- the launches ----------------------------------------------------------------------------------------------------


def fits(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_lora, down_lora) -> bool:
    """Whether `routed_experts` takes these: h [N, H] where kernels run, expert weights [E, 2I, H] and [E, H, I]
    contiguous in h's dtype (fp32/bf16/fp16), each LoRA None or (A [E, R, in], B [E, out, R], scale) contiguous in
    that dtype with R up to 256 (`model.moe.expert_layout`'s layout)."""
    if not runs_here(h) or h.dim() != 2 or h.shape[0] == 0 or h.stride(-1) != 1 or h.dtype not in DTYPES:
        return False
    if gate_up.dim() != 3 or down.dim() != 3 or not (gate_up.is_contiguous() and down.is_contiguous()):
        return False
    experts, width, hidden = gate_up.shape
    if width % 2 or down.shape != (experts, hidden, width // 2) or hidden != h.shape[1]:
        return False
    if gate_up.dtype != h.dtype or down.dtype != h.dtype:
        return False
    for lora, weight in ((gate_up_lora, gate_up), (down_lora, down)):
        if lora is None:
            continue
        lora_a, lora_b, _ = lora
        rank = lora_a.shape[1] if lora_a.dim() == 3 else 0
        if not 0 < rank <= MAX_RANK or lora_a.shape != (experts, rank, weight.shape[2]):
            return False
        if lora_b.shape != (experts, weight.shape[1], rank) or lora_a.dtype != h.dtype or lora_b.dtype != h.dtype:
            return False
        if not (lora_a.is_contiguous() and lora_b.is_contiguous()):
            return False
    return True


def _shrink(x: torch.Tensor, lora, layout: Layout, top_k: int, gather: bool, launch: MoELaunch):
    """(workspace [slots, R_PAD] fp32 of x · A_eᵀ, B, scale, R, R_PAD) of one projection's LoRA, or None."""
    if lora is None:
        return None
    lora_a, lora_b, scale = lora
    rank, features = lora_a.shape[1], lora_a.shape[2]
    r_pad = _pow2(rank)
    block_r = min(r_pad, launch.block_r)
    workspace = torch.empty(layout.rows.numel(), r_pad, dtype=torch.float32, device=x.device)
    _shrink_kernel[(layout.block_experts.numel(), r_pad // block_r)](
        x, x.stride(0), lora_a, workspace, layout.rows, layout.block_experts, features, rank, top_k, GATHER=gather,
        BM=layout.block_m, BR=block_r, BK=launch.block_k, R_PAD=r_pad, EVEN_K=features % launch.block_k == 0,
        PRECISION=precision(x.dtype, True), DOT_F32=interpreting(), num_warps=launch.num_warps,
        num_stages=launch.num_stages, **launch_options(x.device),
    )  # fmt: skip
    return workspace, lora_b, float(scale), rank, r_pad


def _lora_args(shrunk, x: torch.Tensor) -> tuple:
    """(workspace, B, scale, R) and (R_PAD, ROUND_ADAPTER) for a kernel; placeholders without a LoRA."""
    if shrunk is None:
        return (x, x, 1.0, 1), (16, False)
    workspace, lora_b, scale, rank, r_pad = shrunk
    return (workspace, lora_b, scale, rank), (r_pad, lora_b.dtype != torch.float32)


def routed_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, gate_up_lora=None, down_lora=None, ordered: bool = False,
                   launch: MoELaunch = MoELaunch()) -> torch.Tensor:  # fmt: skip
    """The sparse MLP's output [N, H] in h's dtype: sum over j of weights[n, j] * expert experts[n, j]'s SwiGLU
    of h[n] (see `fits` for the operands). ordered: the result depends only on the inputs (no atomics)."""
    count, top_k = experts.shape
    num_experts, width, hidden = gate_up.shape
    inner = width // 2
    pairs = count * top_k
    product = torch.promote_types(down.dtype, weights.dtype)  # the dtype of torch's expert output * routing weight
    if ordered:
        out = torch.empty(pairs, hidden, dtype=product, device=h.device)
    else:  # the atomics' fp32 accumulator, zeroed by the layout's launch
        out = torch.empty(count, hidden, dtype=torch.float32, device=h.device)
    layout = routed_layout(experts, num_experts, launch.block_m or block_rows(pairs, num_experts),
                           None if ordered else out)  # fmt: skip
    grid_rows = layout.block_experts.numel()
    common = dict(BM=layout.block_m, BK=launch.block_k, PRECISION=precision(h.dtype, True), DOT_F32=interpreting(),
                  num_warps=launch.num_warps, num_stages=launch.num_stages, **launch_options(h.device))  # fmt: skip
    shrunk = _shrink(h, gate_up_lora, layout, top_k, True, launch)
    lora, (r_pad, round_adapter) = _lora_args(shrunk, h)
    act = torch.empty(layout.rows.numel(), inner, dtype=gate_up.dtype, device=h.device)
    _gate_up_kernel[(grid_rows, triton.cdiv(inner, launch.block_n))](
        h, h.stride(0), gate_up, lora[0], lora[1], lora[2], act, layout.rows, layout.block_experts, hidden, inner,
        lora[3], top_k, BN=launch.block_n, R_PAD=r_pad, HAS_LORA=shrunk is not None, ROUND_ADAPTER=round_adapter,
        EVEN_K=hidden % launch.block_k == 0, **common,
    )  # fmt: skip
    shrunk = _shrink(act, down_lora, layout, top_k, False, launch)
    lora, (r_pad, round_adapter) = _lora_args(shrunk, act)
    weights = weights.reshape(-1).contiguous()
    _down_kernel[(grid_rows, triton.cdiv(hidden, launch.block_n))](
        act, down, lora[0], lora[1], lora[2], weights, out, layout.rows, layout.block_experts, inner, hidden, lora[3],
        top_k, BN=launch.block_n, R_PAD=r_pad, HAS_LORA=shrunk is not None, ROUND_ADAPTER=round_adapter,
        ROUND_WEIGHTED=product != torch.float32, ORDERED=ordered, EVEN_K=inner % launch.block_k == 0, **common,
    )  # fmt: skip
    if ordered:  # the top-k rows of each token summed in pair order, as the reference sums them
        out = out.view(count, top_k, hidden).sum(dim=1)
    return out.to(h.dtype)
