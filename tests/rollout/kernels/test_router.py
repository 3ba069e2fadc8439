"""The fused top-k router (`kernels.router`) against the reference (`model.moe.route`): Qwen3-MoE's 128 experts and 8
picks with rounded weights, Mixtral's 8 and 2 in fp32, without renormalising, odd token counts and hidden sizes, fp32
and bf16; and the folded router weight held once per rollout (`StagedFactors.router`). On the CPU in Triton's
interpreter; on CUDA in scripts/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kernels import router
from slimrl.rollout.model import moe
from tests.rollout.helpers import build, with_lora
from tests.rollout.kernels.builders import DEVICE, rand
from tests.tolerances import assert_close


def spec(g, experts: int, top_k: int, hidden: int, dtype, normalize: bool, round_weights: bool) -> moe.SparseSpec:
    weight = rand(g, experts, hidden, dtype=dtype, std=hidden**-0.5)
    return moe.SparseSpec(weight, top_k, normalize, round_weights, None, None)


def assert_same_routing(got, h, s: moe.SparseSpec) -> None:
    """The reference's experts, largest first, and its weights to the dtype's rounding. The logits are the
    reference's GEMM's; the kernel's softmax may round otherwise than torch's, so in bf16, where two experts' logits
    are often equal, a token may pick otherwise between probabilities tied to that rounding: there the kernel's
    picks must still be a top k of the reference's probabilities to the dtype's rounding."""
    weights, ids = got
    ref_weights, ref_ids = moe.route(h, s)
    assert weights.dtype == ref_weights.dtype and ids.dtype == ref_ids.dtype == torch.int64
    same = (ids == ref_ids).all(-1)
    if h.dtype == torch.float32:
        assert same.all(), "fp32: the same experts for every token"
    probs = torch.softmax(torch.nn.functional.linear(h, s.router).float(), dim=-1)
    for row in (~same).nonzero().flatten().tolist():
        picked, best = probs[row, ids[row]], probs[row, ref_ids[row]]
        assert_close(picked, best, "bf16", name=f"token {row}'s picked probabilities (a near-tie)")
    kind = "fp32_sum" if h.dtype == torch.float32 else "bf16"
    assert_close(weights[same].float(), ref_weights[same].float(), kind, name="routing weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts, top_k, normalize, round_weights", [(128, 8, True, True), (8, 2, True, False),
                                                                      (60, 4, False, True)])  # fmt: skip
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (37, 200)])
def test_fused_router_matches_the_reference(dtype, experts, top_k, normalize, round_weights, tokens, hidden):
    g = torch.Generator(device=DEVICE).manual_seed(tokens + experts)
    s = spec(g, experts, top_k, hidden, dtype, normalize, round_weights)
    h = rand(g, tokens, hidden, dtype=dtype)
    assert router.fits(h, s.router, top_k)
    got = router.route(h, s.router, top_k, normalize, round_weights)
    assert_same_routing(got, h, s)
    assert torch.equal(moe.fused_route(h, s)[1], got[1])


def test_fits_refuses_what_it_does_not_take():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = rand(g, 4, 64, dtype=torch.float32)
    weight = rand(g, 8, 64, dtype=torch.float32)
    assert router.fits(h, weight, 2)
    assert not router.fits(h, weight.to(torch.bfloat16), 2)  # mixed dtypes
    assert not router.fits(h, weight, 9)  # more picks than experts
    assert not router.fits(h, rand(g, 300, 64, dtype=torch.float32), 2)  # past MAX_EXPERTS
    assert not router.fits(h[:, :32], weight, 2)  # hidden sizes differ


def test_the_folded_router_is_held_and_refreshed_once_per_rollout():
    model = with_lora(build("qwen3_moe"))
    block = next(m for m in model.modules() if moe.is_sparse_block(m))
    gate, wrappers = moe._unwrap(block.gate)
    assert wrappers, "the router carries a LoRA (target_parameters)"
    staged = moe.StagedFactors()
    staged.begin()
    held = staged.router(gate.weight, wrappers[0])
    assert torch.equal(held, moe._folded_router(gate.weight, wrappers[0]))
    lora_b = next(iter(wrappers[0].lora_B.values())).weight
    with torch.no_grad():
        lora_b.add_(0.5)
        assert torch.equal(staged.router(gate.weight, wrappers[0]), held), "the same rollout: not folded again"
        staged.begin()
        again = staged.router(gate.weight, wrappers[0])
    assert again is held and torch.equal(again, moe._folded_router(gate.weight, wrappers[0])), "refreshed in place"
    assert held.data_ptr() in staged.identity()
