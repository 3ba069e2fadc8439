"""The deterministic LoRA shrink (`lora.shrink_(ordered=True)`): K split over several programs whose fp32 partial
sums meet in scratch slots and are added in a fixed two-level order (`common.fixed_order_sum`), not by atomics.

The order, stated: with n K splits s0 ... s[n-1] (64 input features each, the last one partial) and g =
`tree_group(n)` = ceil(sqrt(n)), the sum is ((s0 + ... + s[g-1]) + (s[g] + ... + s[2g-1]) + ...), each parenthesis
added from zero in split order, the group sums then added from zero in group order (24 splits: groups of 5, 5, 5, 5
and 4). In Triton's interpreter (the CPU) programs run one after another, so these tests pin the arithmetic, the
order and the counts' reset; the CUDA test runs the launch where programs finish in any order."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kernels import lora as lora_kernels
from slimrl.rollout.kernels.common import tree_group
from slimrl.rollout.kernels.gemm import SplitScratch
from slimrl.rollout.kernels.lora import padded_rank, shrink_
from tests.rollout.helpers import KERNEL_DEVICE
from tests.tolerances import assert_close

F32, BF16 = torch.float32, torch.bfloat16
SPLIT_K = 64  # input features per K split at these shapes (one BLOCK_K: a launch this small splits K finely)

# (rows, features, rank, x dtype, adapter dtype, adapters): 1, 2, 5, 9 and 24 splits, rows filling part of a 16- and
# a 32-row tile (65: two 64-row tiles, the second with one row), ranks 8 and 64 (two rank blocks), fp32 and bf16
CASES = [
    (1, 40, 8, F32, F32, 1),  # one split: no slots, a plain store
    (17, 64, 64, BF16, F32, 1),
    (3, 70, 64, BF16, BF16, 1),  # 2 splits: one group of 2
    (17, 128, 8, F32, F32, 2),
    (1, 300, 64, F32, F32, 1),  # 5 splits: groups of 3 and 2
    (65, 300, 16, F32, F32, 2),
    (3, 540, 8, F32, F32, 3),  # 9 splits: groups of 3, 3, 3
    (1, 540, 64, BF16, BF16, 1),
    (17, 1500, 64, BF16, F32, 1),  # 24 splits (W1's q/k/v and gate/up shrink count): groups of 5, 5, 5, 5, 4
    (3, 1536, 8, BF16, F32, 3),
]


def recorded_launches(monkeypatch) -> list:
    """(grid, ORDERED, GROUP, GROUPS) of every `_shrink_kernel` launch from now on."""
    launches = []
    real = lora_kernels._shrink_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((tuple(grid), kwargs["ORDERED"], kwargs["GROUP"], kwargs["GROUPS"]))
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


def two_level_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The stated order in plain PyTorch: groups of tree_group(n) consecutive parts, each from zero, then the groups."""
    size = tree_group(len(parts))
    total = torch.zeros_like(parts[0])
    for start in range(0, len(parts), size):
        group = torch.zeros_like(parts[0])
        for part in parts[start : start + size]:
            group = group + part
        total = total + group
    return total


def split_partials(x, lora_as) -> list[torch.Tensor]:
    """Each K split's partial sums [G, M, R_PAD], from an unsplit launch over that split's input features alone
    (the same products, in the same K steps, as the split program's)."""
    parts = []
    for lo in range(0, x.shape[1], SPLIT_K):
        lora_slices = [a[:, lo : lo + SPLIT_K].contiguous() for a in lora_as]
        parts.append(shrink_(x[:, lo : lo + SPLIT_K], lora_slices, tf32=False, ordered=True))
    return parts


@pytest.mark.parametrize("rows, features, rank, x_dtype, a_dtype, adapters", CASES)
def test_ordered_shrink_adds_its_splits_in_the_stated_order(monkeypatch, rows, features, rank, x_dtype, a_dtype,
                                                            adapters):  # fmt: skip
    """Against peft's math (x cast to the adapter dtype, fp32 products) within fp32 summation noise; bit for bit
    against the per-split partials added in the stated order; twice, the same bits (the counts are back at zero
    after each call: the second call would miscount otherwise)."""
    x, lora_as = make_inputs(rows, features, rank, x_dtype, a_dtype, adapters)
    splits = -(-features // SPLIT_K)
    launches = recorded_launches(monkeypatch)
    scratch = SplitScratch()
    runs = [shrink_(x, lora_as, tf32=False, ordered=True, scratch=scratch).clone() for _ in range(2)]
    assert [(grid[2], ordered) for grid, ordered, *_ in launches] == [(splits, splits > 1)] * 2
    if splits > 1:
        assert launches[0][2:] == (tree_group(splits), -(-splits // tree_group(splits))), "group sizes"
        ((_, counts),) = scratch._held.values()
        assert not counts.any(), "a count was left non-zero for the next launch"
    got = runs[0]
    r_pad = padded_rank(rank)
    assert got.shape == (adapters, rows, r_pad) and torch.equal(runs[0], runs[1]), "the same inputs gave other bits"
    expected = torch.stack([x.to(a.dtype).float() @ a.float().t() for a in lora_as])
    assert_close(got[..., :rank], expected, "fp32_sum", name="ordered shrink")
    assert not got[..., rank:].any(), "the shrink past the rank must be zero"

    parts = split_partials(x, lora_as)
    assert torch.equal(got, two_level_sum(parts)), "the splits were not added in the stated order"
    if splits >= 5:  # the case can tell the orders apart: the one-level serial sum gives other bits here
        serial = torch.zeros_like(parts[0])
        for part in parts:
            serial = serial + part
        assert not torch.equal(serial, got), "this case cannot tell the two-level order from the serial one"


def test_ordered_and_atomic_shrinks_agree_and_the_atomic_path_keeps_no_scratch(monkeypatch):
    """Two 64-row tiles, three adapters, 16 splits: the atomic path (no scratch, ORDERED off) and the ordered one
    give the same sums up to fp32 summation order; without a scratch the ordered shrink runs unsplit."""
    x, lora_as = make_inputs(70, 1000, 8, F32, F32, 3)
    launches = recorded_launches(monkeypatch)
    atomic = shrink_(x, lora_as, tf32=False).clone()
    ordered = shrink_(x, lora_as, tf32=False, ordered=True, scratch=SplitScratch()).clone()
    unsplit = shrink_(x, lora_as, tf32=False, ordered=True)
    assert [(grid[2], on) for grid, on, *_ in launches] == [(16, False), (16, True), (1, False)]
    assert launches[0][2:] == (1, 1), "the atomic launch should keep its one specialisation"
    assert_close(atomic, ordered, "fp32_sum", name="atomic vs ordered shrink")
    assert_close(unsplit, ordered, "fp32_sum", name="unsplit vs ordered shrink")


def test_deterministic_engine_with_split_shrinks_decodes_as_generate(monkeypatch):
    """The engine with fused_decode and deterministic on decodes greedily as transformers' generate in fp32, and every
    decode step's q/k/v, o and gate/up shrinks ran ordered with their K split (hidden 192: three splits, groups of 2
    and 1)."""
    from slimrl.rollout.engine import RolloutEngine
    from tests.rollout.helpers import GREEDY, PROMPTS, build, hf_greedy, no_eos, with_lora

    model = no_eos(with_lora(build("qwen2", hidden_size=192, num_attention_heads=3, num_key_value_heads=1,
                                   intermediate_size=160)))  # fmt: skip
    tokens = 3
    expected = hf_greedy(model, PROMPTS, tokens, eos_token_id=None)
    launches = recorded_launches(monkeypatch)
    engine = RolloutEngine(model.to(KERNEL_DEVICE), max_seq_len=64, triton_lora=True, triton_attention=True,
                           fused_decode=True, deterministic=True, cuda_graphs=False, compile=False)  # fmt: skip
    assert engine.generate(PROMPTS, GREEDY, max_new_tokens=tokens).completion_ids == expected
    steps, layers = tokens - 1, 2  # the first token comes from the prefill (no scratch: unsplit)
    split = [(grid[2], groups) for grid, on, *groups in launches if on]
    assert split == [(3, [2, 2])] * (steps * layers * 3), "a decode step's shrink did not run split and ordered"


@pytest.mark.cuda
def test_ordered_shrink_at_w1_shape_gives_the_same_bits_every_time(monkeypatch):
    """W1's q/k/v shrink (64 rows, 1536 features, rank 64, bf16 x, fp32 A, TF32 products as shipped): 24 splits in
    groups of 5. On a GPU the programs finish in another order each run; the bits may not change, eagerly or replayed
    from a CUDA graph (scratch grown by the eager runs, counts reset by their last arrivals). Also against x · Aᵀ."""
    x, lora_as = make_inputs(64, 1536, 64, BF16, F32, 1, device="cuda")
    launches = recorded_launches(monkeypatch)
    scratch = SplitScratch()
    runs = [shrink_(x, lora_as, tf32=True, ordered=True, scratch=scratch).clone() for _ in range(3)]
    assert launches[0][0][2] == 24 and launches[0][1:] == (True, 5, 5), "the launch did not split K as W1's does"
    workspace = torch.zeros(64 * 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shrink_(x, lora_as, workspace, tf32=True, ordered=True, scratch=scratch)
    for _ in range(3):
        graph.replay()
        runs.append(workspace.view(1, 64, 64).clone())
    torch.cuda.synchronize()
    for i, run in enumerate(runs[1:], 1):
        assert torch.equal(runs[0], run), f"run {i} ({'graph' if i > 2 else 'eager'}) gave other bits than run 0"
    ((_, counts),) = scratch._held.values()
    assert not counts.any(), "a count was left non-zero"
    want = x.float() @ lora_as[0].t()
    error = float((runs[0][0] - want).abs().max() / want.abs().max())
    assert error < 1e-2, f"the shrink is off by {error:.3g} of its largest magnitude (TF32 products)"
