"""The deterministic LoRA shrink (`lora.shrink_(ordered=True)`), its three ways.

Up to `PAIR_MAX_FEATURES` input features, where the small tiles give `PAIR_MIN_PROGRAMS` programs, K is split in
two at most and the two fp32 shares meet by atomics in the zeroed workspace: 0 + a + b and 0 + b + a are the same
float. Beyond, K is split over several programs. Over `SLOT_ROWS` rows each stores its fp32 partial sums in a slot
of its own and the last program of each tile to arrive adds the slots in split order, from zero. At other row counts
the partial sums meet as fixed-point integers (`common.fixed_add`), not by fp32 atomics; the last program of each
tile to arrive converts the sum to fp32. The tests force each way at narrower shapes (PAIR_MAX_FEATURES 0, SLOT_ROWS
widened or emptied) and run the fixed point once at its own width.

The fixed-point arithmetic, stated: with n K splits (whole steps of 64 input features, the last one partial) whose
fp32 sums are p0 ... p[n-1], each is truncated to a multiple of 2**-32 (`trunc(p * 2**32)`, an int64), the
integers are added (exactly, so in any order), and the total is converted to fp32 once (round to nearest) and
scaled by 2**-32. A partial that is not finite or not below `fixed_limit(n)` poisons its row: the row reads NaN.
In Triton's interpreter (the CPU) programs run one after another, so these tests pin the arithmetic bit for bit;
the CUDA tests run the launches where programs finish in any order."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kernels import lora as lora_kernels
from slimrl.rollout.kernels.common import FIXED_BITS, fixed_limit
from slimrl.rollout.kernels.lora import padded_rank, shrink_
from tests.rollout.helpers import KERNEL_DEVICE
from tests.tolerances import assert_close

F32, BF16 = torch.float32, torch.bfloat16

# (rows, features, rank, x dtype, adapter dtype, adapters): 1, 2, 5, 9 and 24 splits, rows filling part of a 16- and
# a 32-row tile (65: two 64-row tiles, the second with one row), ranks 8 and 64 (two rank blocks), fp32 and bf16
CASES = [
    (1, 40, 8, F32, F32, 1),  # one split
    (17, 64, 64, BF16, F32, 1),
    (3, 70, 64, BF16, BF16, 1),  # 2 splits
    (17, 128, 8, F32, F32, 2),
    (1, 300, 64, F32, F32, 1),  # 5 splits
    (65, 300, 16, F32, F32, 2),
    (3, 540, 8, F32, F32, 3),  # 9 splits
    (1, 540, 64, BF16, BF16, 1),
    (17, 1500, 64, BF16, F32, 1),  # 24 splits (W1's q/k/v and gate/up shrink count)
    (3, 1536, 8, BF16, F32, 3),
]


def recorded_launches(monkeypatch, with_rows: bool = False, slots: bool = False) -> list:
    """(grid, FIXED, input features per K split) of every `_shrink_kernel` launch from now on; with_rows: and the
    rows of its input; slots: (grid, SLOTS, input features per K split)."""
    launches = []
    real = lora_kernels._shrink_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                way = kwargs["SLOTS" if slots else "FIXED"]
                launches.append((tuple(grid), way, args[12]) + ((args[0].shape[0],) if with_rows else ()))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(lora_kernels, "_shrink_kernel", Recorded())
    return launches


def make_inputs(rows, features, rank, x_dtype, a_dtype, adapters, device=KERNEL_DEVICE):
    g = torch.Generator(device=device).manual_seed(1000 * rows + features + rank)
    x = torch.randn(rows, features, generator=g, device=device).to(x_dtype)
    lora_as = [(torch.randn(rank, features, generator=g, device=device) * features**-0.5).to(a_dtype)
               for _ in range(adapters)]  # fmt: skip
    return x, lora_as


def split_partials(x, lora_as, per_split: int, way: str = "fixed") -> list[torch.Tensor]:
    """Each K split's fp32 partial sums [G, M, R_PAD], from an unsplit atomic launch over that split's input features
    alone, in the tiles of the `way` launch (the same products, in the same K steps and tile shapes, as the split
    program's; added once to zero, so exact)."""
    tiling = lora_kernels._tiling
    parts = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lora_kernels, "_tiling", lambda rows, r_pad, mode: tiling(rows, r_pad, way))
        patch.setattr(lora_kernels, "TARGET_PROGRAMS", 1)  # one program per tile: no atomics' order on a GPU
        for lo in range(0, x.shape[1], per_split):
            lora_slices = [a[:, lo : lo + per_split].contiguous() for a in lora_as]
            parts.append(shrink_(x[:, lo : lo + per_split], lora_slices, tf32=False).clone())
    return parts


def fixed_point_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The stated arithmetic in plain PyTorch: each part truncated to units of 2**-32, summed as int64, converted."""
    units = sum((part.double() * 2.0**FIXED_BITS).trunc().long() for part in parts)
    return units.float() * 2.0**-FIXED_BITS


@pytest.mark.parametrize("rows, features, rank, x_dtype, a_dtype, adapters", CASES)
def test_fixed_point_shrink_is_the_exact_sum_of_its_truncated_splits(monkeypatch, rows, features, rank, x_dtype,
                                                                     a_dtype, adapters):  # fmt: skip
    """Against peft's math (x cast to the adapter dtype, fp32 products) within fp32 summation noise; bit for bit
    against the per-split partials summed as the docstring states; twice, the same bits; the arrival counts are
    back at zero after the launch."""
    monkeypatch.setattr(lora_kernels, "PAIR_MAX_FEATURES", 0)
    monkeypatch.setattr(lora_kernels, "SLOT_ROWS", (0, 0))
    x, lora_as = make_inputs(rows, features, rank, x_dtype, a_dtype, adapters)
    launches = recorded_launches(monkeypatch)
    workspace = torch.zeros(lora_kernels.workspace_elements(adapters, rows, rank, True), device=KERNEL_DEVICE)
    first = shrink_(x, lora_as, workspace, tf32=False, ordered=True).clone()
    again = shrink_(x, lora_as, tf32=False, ordered=True)
    (grid, fixed, per_split), again_launch = launches
    assert fixed and again_launch == launches[0] and grid[2] == -(-features // per_split)
    assert grid[2] > 1 or features <= 64, "K should be split"
    r_pad = padded_rank(rank)
    assert first.dtype == torch.float32 and first.shape == (adapters, rows, r_pad)
    assert torch.equal(first, again), "the same inputs gave other bits"
    cells = adapters * rows * r_pad
    assert not workspace[3 * cells + adapters * rows :].any(), "an arrival count was left set"
    values = first
    expected = torch.stack([x.to(a.dtype).float() @ a.float().t() for a in lora_as])
    assert_close(values[..., :rank], expected, "fp32_sum", name="fixed-point shrink")
    assert not values[..., rank:].any(), "the shrink past the rank must be zero"
    parts = split_partials(x, lora_as, per_split)
    assert torch.equal(values, fixed_point_sum(parts)), "not the stated fixed-point sum"


def test_fixed_point_shrink_at_its_own_width(monkeypatch):
    """Down's shrink at an intermediate of 2,100 features (past PAIR_MAX_FEATURES): fixed point without forcing,
    its K split, the stated sum bit for bit."""
    x, lora_as = make_inputs(3, 2100, 16, BF16, F32, 1)
    assert x.shape[1] > lora_kernels.PAIR_MAX_FEATURES and not lora_kernels.SLOT_ROWS[0] < 3
    launches = recorded_launches(monkeypatch)
    got = shrink_(x, lora_as, tf32=False, ordered=True)
    ((grid, fixed, per_split),) = launches
    monkeypatch.undo()
    assert fixed and grid[2] > 2
    assert torch.equal(got, fixed_point_sum(split_partials(x, lora_as, per_split)))


def test_pair_shrink_adds_at_most_two_shares_in_either_order(monkeypatch):
    """Up to PAIR_MAX_FEATURES features an ordered shrink splits K in two at most (fp32 atomics, no fixed point):
    bit for bit 0 + p0 + p1 of its two shares, which is p1 + p0 as well; twice, the same bits; against peft's math.
    64 and 5 rows (four full 16-row tiles; one partial), three adapters of rank 64 (two 32-column rank blocks), 200
    features: shares of 128 and 72, two K steps each, the second share's last one partial (PAIR_MIN_PROGRAMS 0:
    these row counts give fewer). The arithmetic does not depend on the width; the CUDA test runs W1's 1,536."""
    tiling = lora_kernels._tiling
    features, per_share = 200, 128
    for rows in (64, 5):
        x, lora_as = make_inputs(rows, features, 64, BF16, F32, 3)
        monkeypatch.setattr(lora_kernels, "PAIR_MIN_PROGRAMS", 0)
        launches = recorded_launches(monkeypatch)
        got = shrink_(x, lora_as, tf32=False, ordered=True)
        ((grid, fixed, per_split),) = launches[-1:]
        assert not fixed and grid[2] == 2 and per_split == per_share, "two K splits of 128 features, fp32 atomics"
        assert torch.equal(got, shrink_(x, lora_as, tf32=False, ordered=True)), "the same inputs gave other bits"
        monkeypatch.undo()
        monkeypatch.setattr(lora_kernels, "_tiling", lambda rows, r_pad, mode: tiling(rows, r_pad, "pair"))
        monkeypatch.setattr(lora_kernels, "TARGET_PROGRAMS", 1)  # unsplit: no atomics' order on a GPU
        first, second = (shrink_(x[:, lo : lo + per_share], [a[:, lo : lo + per_share].contiguous()
                                                             for a in lora_as], tf32=False)
                         for lo in (0, per_share))  # fmt: skip
        monkeypatch.undo()
        assert torch.equal(got, (torch.zeros_like(first) + first) + second)
        assert torch.equal(got, (torch.zeros_like(first) + second) + first)
        expected = torch.stack([x.float() @ a.t() for a in lora_as])
        assert_close(got[..., :64], expected, "fp32_sum", name="pair shrink")


def test_ordered_shrinks_pick_their_way_by_width_rows_and_programs():
    """W1's shapes as shipped: q/k/v (1,536 features, three adapters, rank 64) in fixed point at 8 and 64 rows (48
    pair programs at 64) and as a pair at 256 (192); o's (one adapter: 64 pair programs) and down's 8,960 features
    in fixed point at 8 and 64 rows and in slots at 256; atomic when not ordered."""
    modes = {(rows, features, group): lora_kernels._mode(rows, features, group, 64, True)
             for rows in (8, 64, 256) for features, group in ((1536, 3), (1536, 1), (8960, 1))}  # fmt: skip
    assert modes == {(8, 1536, 3): "fixed", (8, 1536, 1): "fixed", (8, 8960, 1): "fixed",
                     (64, 1536, 3): "fixed", (64, 1536, 1): "fixed", (64, 8960, 1): "fixed",
                     (256, 1536, 3): "pair", (256, 1536, 1): "slots", (256, 8960, 1): "slots"}  # fmt: skip
    assert lora_kernels._mode(256, 1536, 3, 64, False) == "atomic"


def test_fixed_point_shrink_poisons_rows_it_cannot_hold(monkeypatch):
    """A NaN, an infinity and a value whose products pass `fixed_limit` in three rows of x: those rows read NaN
    in every adapter's columns (the float sum gives NaN for the first two and a huge value for the third), and
    the other rows are the exact fixed-point sums; the expand (`lora_group_`) carries the NaN into those rows of
    the outputs only."""
    monkeypatch.setattr(lora_kernels, "PAIR_MAX_FEATURES", 0)
    monkeypatch.setattr(lora_kernels, "SLOT_ROWS", (0, 0))
    x, lora_as = make_inputs(7, 300, 8, F32, F32, 2)
    x[1, 10], x[3, 200], x[5, 0] = float("nan"), float("inf"), 1e20
    values = shrink_(x, lora_as, tf32=False, ordered=True)
    bad = torch.tensor([False, True, False, True, False, True, False])
    assert torch.isnan(values[:, bad]).all(), "a row with a share out of range was not poisoned"
    assert torch.isfinite(values[:, ~bad]).all()
    clean = x.clone()
    clean[bad] = 0.0
    assert torch.equal(values[:, ~bad], shrink_(clean, lora_as, tf32=False, ordered=True)[:, ~bad])

    outputs = [torch.zeros(7, 24, device=KERNEL_DEVICE) for _ in lora_as]
    items = [(y, (a, torch.randn(24, 8, device=KERNEL_DEVICE), 0.5)) for y, a in zip(outputs, lora_as, strict=True)]
    lora_kernels.lora_group_(x, items, tf32=False, ordered=True)
    for y in outputs:
        assert torch.isnan(y[bad]).all() and torch.isfinite(y[~bad]).all()


def test_fixed_limit_keeps_every_sum_inside_int64():
    """n shares each just below fixed_limit(n) sum to less than 2**62 units of 2**-32, for every n up to 4,096."""
    for shares in range(1, 4097):
        limit = fixed_limit(shares)
        assert shares * limit * 2.0**FIXED_BITS <= 2.0**62, shares
        assert limit >= 2.0**17, "the range should not shrink below what a working model's shrink can reach"


def test_fixed_point_and_atomic_shrinks_agree(monkeypatch):
    """Two 64-row tiles (three 32-row tiles in fixed point), three adapters, 6 splits, the last of 10 features: the
    atomic path and the fixed-point one give the same sums up to fp32 summation order."""
    monkeypatch.setattr(lora_kernels, "PAIR_MAX_FEATURES", 0)
    monkeypatch.setattr(lora_kernels, "SLOT_ROWS", (0, 0))
    x, lora_as = make_inputs(70, 330, 8, F32, F32, 3)
    launches = recorded_launches(monkeypatch)
    atomic = shrink_(x, lora_as, tf32=False)
    fixed = shrink_(x, lora_as, tf32=False, ordered=True)
    assert [(grid[2], in_fixed_point) for grid, in_fixed_point, _ in launches] == [(6, False), (6, True)]
    assert_close(atomic, fixed, "fp32_sum", name="atomic vs fixed-point shrink")


def test_deterministic_engine_with_split_shrinks_decodes_as_generate(monkeypatch):
    """The engine with fused_decode and deterministic on decodes greedily as transformers' generate in fp32, with its
    shrinks forced to fixed point (hidden 192: three splits), as slots (three splits) and as pairs (two splits,
    fp32); the decode launches take their shrinks from `shrink_` launches here (`KernelChoice.shrink_k` 0)."""
    from slimrl.rollout.engine import RolloutEngine
    from slimrl.rollout.fused_ops import choices_for
    from slimrl.rollout.planning import bucket
    from tests.rollout.helpers import GREEDY, PROMPTS, build, hf_greedy, no_eos, with_lora
    from tests.rollout.kernels.builders import separate_shrinks

    model = no_eos(with_lora(build("qwen2", hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                                   intermediate_size=160)))  # fmt: skip
    tokens = 2  # one decode step (the first token comes from the prefill) runs every layer's four shrinks
    expected = hf_greedy(model, PROMPTS, tokens, eos_token_id=None)
    model = model.to(KERNEL_DEVICE)
    steps, layers = tokens - 1, 2
    ways = (
        (0, (0, 0), False, (3, True)),
        (0, (0, 1 << 30), True, (3, True)),
        (lora_kernels.PAIR_MAX_FEATURES, (0, 0), False, (2, False)),
    )  # (the flag: FIXED, SLOTS, FIXED)
    for pair_max, slot_rows, slots, want in ways:
        monkeypatch.setattr(lora_kernels, "PAIR_MAX_FEATURES", pair_max)
        monkeypatch.setattr(lora_kernels, "PAIR_MIN_PROGRAMS", 0)  # (a few rows here)
        monkeypatch.setattr(lora_kernels, "SLOT_ROWS", slot_rows)
        launches = recorded_launches(monkeypatch, with_rows=True, slots=slots)
        choices = separate_shrinks(choices_for(torch.device(KERNEL_DEVICE))[0])
        engine = RolloutEngine(model, max_seq_len=64, triton_lora=True, triton_attention=True, fused_decode=True,
                               deterministic=True, cuda_graphs=False, compile=False,
                               kernel_choices=choices)  # fmt: skip
        assert engine.generate(PROMPTS, GREEDY, max_new_tokens=tokens).completion_ids == expected
        # one row tile: the decode steps' (a row per prompt, in a batch bucket of 4) and the prefill's (its tokens)
        tiled = [(grid[2], fixed) for grid, fixed, _, _ in launches if grid[0] == 1]
        decode = [rows for grid, _, _, rows in launches if grid[0] == 1 and rows == bucket(len(PROMPTS))]
        assert len(decode) >= steps * layers * 4 and set(tiled) == {want}, "a shrink did not run as set"
        monkeypatch.undo()


@pytest.mark.cuda
@pytest.mark.parametrize("rows, features, adapters, launch", [(64, 1536, 3, ((2, 12, 8), True)),
                                                              (256, 1536, 3, ((16, 6, 2), False)),
                                                              (64, 8960, 1, ((2, 4, 28), True)),
                                                              (256, 1536, 1, ((16, 2, 12), False)),
                                                              (256, 8960, 1, ((16, 2, 16), False))])  # fmt: skip
def test_ordered_shrink_at_w1_shapes_gives_the_same_bits_every_time(monkeypatch, rows, features, adapters, launch):
    """W1's q/k/v shrink (1536 features; at 64 rows fixed point in 8 K splits, at 256 two splits added by fp32
    atomics), o's at 256 rows (slots, 12 splits) and down's (8960 features: fixed point in 28 splits at 64 rows,
    slots in 16 at 256), rank 64, bf16 x, fp32 A, TF32 products as shipped.
    On a GPU the programs finish in another order each run; the bits may not change, eagerly or replayed from a
    CUDA graph. Also against x · Aᵀ."""
    x, lora_as = make_inputs(rows, features, 64, BF16, F32, adapters, device="cuda")
    launches = recorded_launches(monkeypatch)
    runs = [shrink_(x, lora_as, tf32=True, ordered=True).clone() for _ in range(3)]
    assert launches[0][:2] == launch, "the launch did not tile and split K as W1's does"
    workspace = torch.zeros(lora_kernels.workspace_elements(adapters, rows, 64, True), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shrunk = shrink_(x, lora_as, workspace, tf32=True, ordered=True)
    for _ in range(3):
        workspace.zero_()
        graph.replay()
        runs.append(shrunk.clone())
    torch.cuda.synchronize()
    for i, run in enumerate(runs[1:], 1):
        assert torch.equal(runs[0], run), f"run {i} ({'graph' if i > 2 else 'eager'}) gave other bits than run 0"
    expected = torch.stack([x.float() @ a.t() for a in lora_as])
    error = float((runs[0][..., :64] - expected).abs().max() / expected.abs().max())
    assert error < 1e-2, f"the shrink is off by {error:.3g} of its largest magnitude (TF32 products)"


def in_split_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The slots' stated arithmetic: fp32 sums from zero, split 0 first."""
    total = torch.zeros_like(parts[0])
    for part in parts:
        total = total + part
    return total


@pytest.mark.parametrize("rows, features, rank, x_dtype, a_dtype, adapters", CASES)
def test_slot_shrink_adds_its_splits_in_split_order(monkeypatch, rows, features, rank, x_dtype, a_dtype, adapters):
    """Slots forced at every row count: against peft's math within fp32 summation noise; bit for bit the per-split
    partials added in split order from zero; twice, the same bits; the arrival counts back at zero; with the slot
    scratch given (`slot_elements`, unzeroed: filled with garbage first) and made by the launch. Where the program
    count leaves two splits at most, the launch is a pair (fp32 atomics into zero) instead."""
    monkeypatch.setattr(lora_kernels, "PAIR_MAX_FEATURES", 0)
    monkeypatch.setattr(lora_kernels, "SLOT_ROWS", (0, 1 << 30))
    x, lora_as = make_inputs(rows, features, rank, x_dtype, a_dtype, adapters)
    launches = recorded_launches(monkeypatch, slots=True)
    workspace = torch.zeros(lora_kernels.workspace_elements(adapters, rows, rank, True), device=KERNEL_DEVICE)
    scratch = torch.full((lora_kernels.slot_elements(rows, rank),), float("nan"), device=KERNEL_DEVICE)
    first = shrink_(x, lora_as, workspace, tf32=False, ordered=True, slots=scratch).clone()
    again = shrink_(x, lora_as, tf32=False, ordered=True)
    (grid, slotted, per_split), again_launch = launches
    monkeypatch.undo()
    assert again_launch == launches[0] and grid[2] == -(-features // per_split)
    assert slotted == (grid[2] > 2), "more than two splits meet in slots, two at most as a pair"
    assert torch.equal(first, again), "the same inputs gave other bits"
    cells = adapters * rows * padded_rank(rank)
    assert not workspace[cells:].any(), "an arrival count was left set"
    expected = torch.stack([x.to(a.dtype).float() @ a.float().t() for a in lora_as])
    assert_close(first[..., :rank], expected, "fp32_sum", name="slot shrink")
    assert not first[..., rank:].any(), "the shrink past the rank must be zero"
    if slotted:
        parts = split_partials(x, lora_as, per_split, "slots")
        assert torch.equal(first, in_split_order(parts)), "not the partials added in split order"


def test_slot_shrink_carries_nan_and_infinity_as_a_float_sum(monkeypatch):
    """A NaN and an infinity in two rows of x, through the slots (nine splits): the first row reads NaN everywhere,
    the second ±infinity as the float sum x · Aᵀ gives it (one infinite product per column), and the other rows are
    as from the clean input."""
    monkeypatch.setattr(lora_kernels, "SLOT_ROWS", (0, 1 << 30))
    x, lora_as = make_inputs(5, 540, 8, F32, F32, 2)
    launches = recorded_launches(monkeypatch, slots=True)
    x[1, 10], x[3, 200] = float("nan"), float("inf")
    values = shrink_(x, lora_as, tf32=False, ordered=True)
    assert launches[-1][1] and launches[-1][0][2] > 2, "the slots did not run"
    bad = torch.tensor([False, True, False, True, False])
    assert torch.isnan(values[:, 1]).all() and torch.isfinite(values[:, ~bad]).all()
    expected = torch.stack([x[3:4] @ a.t() for a in lora_as])[:, 0]
    assert torch.isinf(expected).all() and torch.equal(values[:, 3, :8], expected)
    clean = x.clone()
    clean[bad] = 0.0
    assert torch.equal(values[:, ~bad], shrink_(clean, lora_as, tf32=False, ordered=True)[:, ~bad])


def test_slot_scratch_holds_every_ordered_shrink_of_its_rows():
    """`slot_elements(rows, rank)` is at least what any slot launch over those rows needs, whatever the width and
    adapter count (GroupedLoRA makes one per forward; none outside SLOT_ROWS)."""
    low, high = lora_kernels.SLOT_ROWS
    assert lora_kernels.slot_elements(low, 64) == 0 and lora_kernels.slot_elements(high + 1, 64) == 0
    for rows in (low + 1, 100, high):
        for rank in (8, 64, 128):
            r_pad = padded_rank(rank)
            block_m, block_r = lora_kernels._tiling(rows, r_pad, "slots")
            for group in (1, 2, 3):
                for features in (64, 1536, 8960, 100_000):
                    tiles = -(-rows // block_m) * group * (r_pad // block_r)
                    splits = lora_kernels._splits(features, tiles, lora_kernels.TARGET_PROGRAMS)
                    need = tiles * splits * block_m * block_r if splits > 2 else 0
                    assert lora_kernels.slot_elements(rows, rank) >= need, (rows, rank, group, features)
