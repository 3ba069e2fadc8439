"""What the decode step's Triton kernels share: programmatic dependent launch, rounding, precision and tiles.

## Programmatic dependent launch (PDL)

A decode step is a chain of about 350 short launches. Launched normally, each kernel is scheduled only after the one
before it has finished and flushed, so every boundary costs a launch gap plus the new kernel's ramp-up. On Hopper
and later a kernel launched with PDL may be scheduled as soon as every program of the kernel before it has started;
its programs then wait at `griddepcontrol.wait` until that kernel has finished and its writes are visible.

Every kernel launched through `options` calls `enter(PDL)` first, before it reads or writes anything: the wait comes
before any memory access, so results are those of ordinary stream order (a chain stays ordered: a kernel finishes
only after its own wait on the one before). `enter` then lets the next kernel be scheduled. Captured into a CUDA
graph, the launches keep these programmatic edges. Kernels of other libraries (cuBLAS, compiled norms) launch as
before and are waited for as before.

Why every chain this builds is ordered, whatever the kernels around it:
- PDL kernel after PDL kernel: the second's programs touch no memory before `griddepcontrol.wait`, which returns only
  once the first has completed and its writes are visible: no read-after-write nor write-after-read race.
- Transitively: a kernel completes only after its own wait returned, so when kernel n+1 passes its wait, kernels
  n, n-1, ... have all completed; a reader two launches downstream of a writer is as safe as the next one.
- PDL kernel after another library's kernel (cuBLAS, Inductor): that kernel never signals early, so the dependent is
  released at its completion, as in ordinary stream order; the wait then returns at once.
- Another library's kernel after a PDL kernel: launched without the attribute, it starts after the PDL kernel has
  completed, as always.
- Host code, copies and other streams see stream order as usual: PDL relaxes only kernel-to-kernel scheduling inside
  the stream, and a graph replay ends when its last kernel has completed.
The training-step NaN that once looked like an ordering fault of this chain was cuDNN's SDPA backward
(`slimrl.ops.attention_backends`): the same collapse happened with SLIMRL_PDL=0, and none once cuDNN's SDPA was off.

`MODE` (`SLIMRL_PDL`, read at import; set it before an engine captures): 1 (default) as above, 0 ordinary launches.
Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slimrl.ops.kernels.rounding import round_to  # noqa: F401 - the training kernels' rounding, the same here

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # a Triton without grid dependency control: never launched with PDL, so never traced
    gdc_launch_dependents = gdc_wait = None
    _HAVE_GDC = False

MODE = int(os.environ.get("SLIMRL_PDL", "1"))
_CAPABLE: dict[int, bool] = {}
_SM_COUNT: dict[int, int] = {}


def _capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABLE:
        _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _CAPABLE[index]


def compiled_for_cuda(device: torch.device) -> bool:
    """Whether kernels launched for tensors on `device` are compiled for a GPU (so PTX-level instructions may be
    used): a CUDA device and not Triton's interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def options(device: torch.device) -> dict:
    """Launch keywords for a kernel whose first memory access follows `enter(PDL)`: PDL on CUDA devices of
    compute capability 9 and later (not under Triton's interpreter, which has no grid dependency control)."""
    on = MODE > 0 and _HAVE_GDC and compiled_for_cuda(device) and _capable(device)
    return {"PDL": MODE if on else 0, "launch_pdl": bool(on)}


@triton.jit
def enter(PDL: tl.constexpr):
    """Wait for the kernel before this one to finish (its writes visible) and let the next one be scheduled."""
    if PDL > 0:
        gdc_wait()
        gdc_launch_dependents()


# -- arithmetic and tiles --------------------------------------------------------------------------------------------


def precision(dtype: torch.dtype, tf32: bool) -> str:
    return "tf32" if tf32 and dtype != torch.float32 else "ieee"


def block_m(rows: int, block_m: int = 0) -> int:
    """Rows per program: `block_m` when given (16 ... 128), else the smallest of 16, 32, 64 that holds them."""
    if block_m:
        return block_m
    return 16 if rows <= 16 else (32 if rows <= 32 else 64)


def sm_count(device: torch.device) -> int:
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
    programs = max(1, per_sm * sm_count(device) // row_blocks)
    return max(1, min(block_n, triton.cdiv(width, programs)))


@triton.jit
def pick(index, p0, p1, p2):
    """p0, p1 or p2 by index (0, 1, anything else): one of up to three tensors a launch serves (q, k, v)."""
    if index == 0:
        return p0
    elif index == 1:
        return p1
    return p2


# -- sums that do not depend on the order of their terms -------------------------------------------------------------

FIXED_BITS = 32  # fractional bits of the deterministic sums' fixed point: units of 2**-32
_TO_FIXED = tl.constexpr(2.0**FIXED_BITS)
_FROM_FIXED = tl.constexpr(2.0**-FIXED_BITS)


def fixed_limit(shares: int) -> float:
    """The largest magnitude a share of `fixed_add` may have when `shares` of them meet in one sum: their sum in
    units of 2**-FIXED_BITS then stays below 2**62, inside int64, whatever their signs."""
    return 2.0 ** (62 - FIXED_BITS - max(shares - 1, 0).bit_length())


@triton.jit
def fixed_add(sum_ptrs, poison_ptrs, part, rows_ok, mask, limit):
    """Adds the fp32 shares `part` [BM, BN] into the int64 sums at sum_ptrs (a zeroed [BM, BN] tile) as fixed point:
    each share truncated to a multiple of 2**-FIXED_BITS, then integer atomics, which give the same bits in any
    order. The sum is the exact sum of the truncated shares, rounded once when `fixed_load` converts it.

    A share that is not finite or not below `limit` (`fixed_limit`) cannot be held: its row's poison (fp32 [BM] at
    poison_ptrs, zeroed) gets NaN instead (NaN + 0 = NaN in any order), and `fixed_load` gives NaN for that row, as
    a NaN input gives the float sum. rows_ok [BM]: the rows this tile holds."""
    bad = (part != part) | (tl.abs(part) >= limit)
    units = (tl.where(bad, 0.0, part) * _TO_FIXED).to(tl.int64)
    tl.atomic_add(sum_ptrs, units, mask=mask, sem="relaxed")
    bad_rows = tl.max(bad.to(tl.int32), axis=1)
    if tl.max(bad_rows, axis=0) > 0:
        tl.atomic_add(poison_ptrs, tl.where(bad_rows > 0, float("nan"), 0.0), mask=rows_ok & (bad_rows > 0),
                      sem="relaxed")  # fmt: skip


@triton.jit
def fixed_load(sum_ptrs, poison_ptrs, rows_ok, mask):
    """The fp32 values [BM, BN] of `fixed_add`'s sums (int64 at sum_ptrs), NaN in rows whose poison is NaN; read
    from L2 (.cg), where the other programs' atomics landed."""
    units = tl.load(sum_ptrs, mask=mask, other=0, cache_modifier=".cg")
    poison = tl.load(poison_ptrs, mask=rows_ok, other=0.0, cache_modifier=".cg")
    return units.to(tl.float32) * _FROM_FIXED + poison[:, None]


# -- partial sums that meet in a fixed order ------------------------------------------------------------------------


@triton.jit
def last_to_arrive(cnt_ptr, tile, splits):
    """Whether this program is the last of the `splits` programs sharing `tile` to finish its share, counted in
    cnt[tile] (int32, zero between launches) once the share's stores or atomics are issued; the last one sees every
    other's writes (acq_rel) and zeroes the count for the next launch (all of them have counted by then)."""
    tl.debug_barrier()  # every thread's writes are issued before the count is released
    last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1
    if last:
        tl.store(cnt_ptr + tile, 0)
    return last


@triton.jit
def add_slots_in_order(acc0, acc1, slots, cells, split, splits, cnt_ptr, tile, SLOT: tl.constexpr,
                       PARTS: tl.constexpr, TWO: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    """fp32 partial sums of one tile that `splits` programs share (this one the `split`-th), added in split order so
    that the sum does not depend on which finished first. Each program stores acc0 (and acc1 when TWO) in its own
    slots of the tile's unzeroed fp32 scratch (split s, part j at slots + (s * PARTS + j) * SLOT + cells); the last
    to arrive (`last_to_arrive`) adds every split's slots from zero, reading them from L2 (.cg), where the other SMs'
    stores landed; UNROLL (splits a constexpr) unrolls that loop. Returns (acc0, acc1, whether this program holds
    the sums); the others get their own partials back."""
    tl.store(slots + (split * PARTS) * SLOT + cells, acc0)
    if TWO:
        tl.store(slots + (split * PARTS + 1) * SLOT + cells, acc1)
    last = last_to_arrive(cnt_ptr, tile, splits)
    if last:
        acc0 = tl.zeros_like(acc0)
        acc1 = tl.zeros_like(acc1)
        if UNROLL:
            for s in tl.static_range(splits):
                acc0 += tl.load(slots + (s * PARTS) * SLOT + cells, cache_modifier=".cg")
                if TWO:
                    acc1 += tl.load(slots + (s * PARTS + 1) * SLOT + cells, cache_modifier=".cg")
        else:
            for s in range(0, splits):
                acc0 += tl.load(slots + (s * PARTS) * SLOT + cells, cache_modifier=".cg")
                if TWO:
                    acc1 += tl.load(slots + (s * PARTS + 1) * SLOT + cells, cache_modifier=".cg")
    return acc0, acc1, last
