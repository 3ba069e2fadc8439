"""What the decode kernels share (`kernels.common`): programmatic dependent launch only where the device has it;
partial sums that meet in split order (on the CPU in Triton's interpreter, where programs run one after another; on
CUDA, where they finish in any order)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels.common import add_slots_in_order
from tests.rollout.helpers import KERNEL_DEVICE


def test_programmatic_dependent_launch_only_where_the_device_has_it(monkeypatch):
    from slimrl.rollout.kernels import common as pdl

    # Triton's interpreter and CPU tensors have no grid dependency control: the kernels launch as usual there
    assert pdl.options(torch.device("cpu")) == {"PDL": 0, "launch_pdl": False}
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl.options(torch.device("cuda"))["launch_pdl"] == (hopper and pdl._HAVE_GDC)
        monkeypatch.setattr(pdl, "MODE", 0)  # SLIMRL_PDL=0
        assert pdl.options(torch.device("cuda")) == {"PDL": 0, "launch_pdl": False}


# -- partial sums that meet in a fixed order (common.add_slots_in_order, common.last_to_arrive) ----------------------


@triton.jit
def _slot_sums_probe(part_ptr, slots_ptr, cnt_ptr, out_ptr, last_ptr, SPLITS: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, TWO: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    """Program (tile, split) adds its partial pair part[tile, split] through the helper; the program holding the
    sums writes them to out[tile] and every program adds whether it holds them to last[tile]."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    cells = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    pair = (tile * SPLITS + split) * 2 * BM * BN
    acc0 = tl.load(part_ptr + pair + cells)
    acc1 = tl.load(part_ptr + pair + BM * BN + cells)
    slots = slots_ptr + tile * (SPLITS * 2 * BM * BN)
    if UNROLL:  # the split count a constexpr, as split-K launches have it
        acc0, acc1, last = add_slots_in_order(acc0, acc1, slots, cells, split, SPLITS, cnt_ptr, tile, BM * BN, 2, TWO,
                                              True)  # fmt: skip
    else:  # a runtime count, as the shrinks have it
        acc0, acc1, last = add_slots_in_order(acc0, acc1, slots, cells, split, tl.num_programs(1), cnt_ptr, tile,
                                              BM * BN, 2, TWO, False)  # fmt: skip
    tl.atomic_add(last_ptr + tile, last.to(tl.int32))
    if last:
        tl.store(out_ptr + tile * 2 * BM * BN + cells, acc0)
        if TWO:
            tl.store(out_ptr + tile * 2 * BM * BN + BM * BN + cells, acc1)


@pytest.mark.parametrize("splits", [1, 3, 5])
@pytest.mark.parametrize("two", [False, True])
@pytest.mark.parametrize("unroll", [False, True])
def test_slot_sums_add_the_splits_in_split_order_once_and_leave_the_counts_at_zero(splits, two, unroll):
    tiles, bm, bn = 2, 4, 8
    gen = torch.Generator().manual_seed(splits)
    part = torch.randn(tiles, splits, 2, bm, bn, generator=gen)
    # magnitudes where fp32 addition is not associative: in split order 1e8 - 1e8 + x gives x, in reverse order
    # x - 1e8 + 1e8 gives a multiple of 8 (x lost to rounding)
    part[:, 0] *= 1e8
    if splits > 1:
        part[:, 1] = -part[:, 0]
    part = part.to(KERNEL_DEVICE)
    slots = torch.full((tiles * splits * 2 * bm * bn,), float("nan"), device=KERNEL_DEVICE)  # unzeroed scratch
    counts = torch.zeros(tiles, dtype=torch.int32, device=KERNEL_DEVICE)
    expected = torch.zeros(tiles, 2, bm, bn, device=KERNEL_DEVICE)
    for s in range(splits):  # from zero, in split order, one fp32 add at a time
        expected = expected + part[:, s]
    for launch in range(2):  # the second launch finds the counts the first left behind
        out = torch.zeros(tiles, 2, bm, bn, device=KERNEL_DEVICE)
        holders = torch.zeros(tiles, dtype=torch.int32, device=KERNEL_DEVICE)
        _slot_sums_probe[(tiles, splits)](part, slots, counts, out, holders, SPLITS=splits, BM=bm, BN=bn, TWO=two,
                                          UNROLL=unroll)  # fmt: skip
        assert holders.tolist() == [1] * tiles, launch  # exactly one program of each tile holds the sums
        assert counts.tolist() == [0] * tiles, launch
        assert torch.equal(out[:, 0], expected[:, 0]), launch
        if two:
            assert torch.equal(out[:, 1], expected[:, 1]), launch
        else:  # acc1 is not stored, nor added
            assert not out[:, 1].any(), launch
    if splits > 2:  # the data tell split order from the reverse one
        reverse = torch.zeros_like(expected)
        for s in reversed(range(splits)):
            reverse = reverse + part[:, s]
        assert not torch.equal(expected, reverse)
