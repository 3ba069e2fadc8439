"""The fused MoE decode kernels (`kernels.moe`) against the reference routed MLP (`model.moe.expert_mix`): the routing
layout worked out by hand, odd shapes with and without LoRA in fp32 and bf16, an expert without rows, every row on
one expert, the deterministic mode bit for bit, and the engine's greedy output with them on. On the CPU the kernels
run in Triton's interpreter (tests/conftest.py); the CUDA tests run at Qwen3-30B-A3B's layer shape and under a
captured graph (scripts/gpu_check.sh)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from slimrl.rollout.kernels import moe as moe_kernels
from slimrl.rollout.model import moe
from tests.rollout.helpers import GREEDY, PROMPTS, build, hf_greedy, no_eos, with_lora
from tests.rollout.kernels.builders import DEVICE, rand
from tests.tolerances import assert_close

HIDDEN, INNER, EXPERTS = 64, 40, 8  # an intermediate size that is no multiple of the kernels' tiles


def sparse(g, rank, dtype, top_k=2, experts=EXPERTS, hidden=HIDDEN, inner=INNER, round_weights=True, b_std=0.2):
    """A random SparseSpec in `expert_layout`'s layout. rank: of both projections' LoRA, or (gate_up's, down's);
    0: experts without LoRA. LoRA B's std `b_std` (scale 2): at 0.2 a kernel dropping the LoRA fails the tests."""
    ranks = rank if isinstance(rank, tuple) else (rank, rank)

    def projection(out_features, in_features, r):
        weight = rand(g, experts, out_features, in_features, dtype=dtype, std=in_features**-0.5)
        if not r:
            return moe.ExpertProjection(weight, ())
        lora_a = rand(g, experts, r, in_features, dtype=dtype, std=in_features**-0.5)
        lora_b = rand(g, experts, out_features, r, dtype=dtype, std=b_std)
        return moe.ExpertProjection(weight, ((lora_a, lora_b, 2.0),))

    router = rand(g, experts, hidden, dtype=dtype)
    gate_up, down = projection(2 * inner, hidden, ranks[0]), projection(hidden, inner, ranks[1])
    return moe.SparseSpec(router, top_k, True, round_weights, gate_up, down)


def kernel_mix(h, weights, experts, spec, ordered):
    out = moe.fused_expert_mix(h, weights, experts, spec, ordered)
    assert out is not None, "the kernels should take this spec"
    return out


# -- the routing layout ----------------------------------------------------------------------------------------------


def test_layout_groups_pairs_by_expert_in_pair_order_padded_to_blocks():
    # pairs (token * k + j) 0..7 of 4 tokens, top-2, over 5 experts, blocks of 2 rows: expert 0 gets pairs 1 and 4,
    # 1 gets 3, 2 gets 7, 3 gets 0, 2, 5, 6 (two blocks), 4 none; min(5, 8) + 8 // 2 = 9 blocks, four left unused
    experts = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEVICE)
    layout = moe_kernels.routed_layout(experts, 5, 2)
    assert layout.rows.view(-1, 2).tolist() == [[1, 4], [3, -1], [7, -1], [0, 2], [5, 6]] + [[-1, -1]] * 4
    assert layout.block_experts.tolist() == [0, 1, 2, 3, 3, -1, -1, -1, -1]


def test_layout_over_many_chunks_equals_the_loop_that_states_it():
    # 300 experts: the kernel's one-hot tiles are [16, 512], so 80 pairs take five chunks and 85 blocks six
    experts = torch.randint(0, 300, (40, 2), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    experts[5:9] = 17  # an expert with eight rows across the first chunk's end
    layout = moe_kernels.routed_layout(experts, 300, 16)
    rows, owners = [], []
    for expert in range(300):
        mine = [pair for pair, e in enumerate(experts.reshape(-1).tolist()) if e == expert]
        while mine:
            rows += mine[:16] + [-1] * (16 - len(mine[:16]))
            owners.append(expert)
            mine = mine[16:]
    blocks = moe_kernels.max_blocks(80, 300, 16)
    assert layout.block_experts.tolist() == owners + [-1] * (blocks - len(owners))
    assert layout.rows.tolist() == rows + [-1] * (16 * blocks - len(rows))


def test_layout_of_every_pair_on_one_expert():
    layout = moe_kernels.routed_layout(torch.full((17, 2), 6, device=DEVICE), EXPERTS, 16)
    assert layout.block_experts.tolist() == [6, 6, 6] + [-1] * 7  # 34 rows in three blocks of 16
    assert layout.rows[:34].tolist() == list(range(34)) and set(layout.rows[34:].tolist()) == {-1}


@pytest.mark.parametrize("values", [5, 20000])
def test_layout_launch_zeroes_the_accumulator_it_is_given(values):
    # the 7 experts' programs share the values: 5 (one each, the last two none), 20,000 (2,858 each, three stores of
    # 1,024, the last share shorter); the layout is the one without an accumulator
    experts = torch.tensor([[3, 0], [3, 1], [0, 6]], device=DEVICE)
    accumulator = torch.full((values,), float("nan"), device=DEVICE)
    layout = moe_kernels.routed_layout(experts, 7, 2, accumulator)
    assert torch.equal(accumulator, torch.zeros_like(accumulator))
    plain = moe_kernels.routed_layout(experts, 7, 2)
    assert torch.equal(layout.rows, plain.rows) and torch.equal(layout.block_experts, plain.block_experts)


# -- against the reference -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "top_k", "rank", "dtype", "round_weights"),
    [
        (1, 2, 0, torch.float32, True),
        (3, 3, 4, torch.float32, True),
        (17, 2, 8, torch.float32, False),
        (17, 3, 8, torch.bfloat16, True),  # Qwen3-MoE: routing weights rounded to bf16
        (3, 2, 4, torch.bfloat16, False),  # Mixtral: fp32 routing weights, the weighted rows in fp32
        (1, 3, 0, torch.bfloat16, True),
        (3, 2, 4, torch.float16, True),
    ],
)
def test_routed_experts_match_the_reference(tokens, top_k, rank, dtype, round_weights):
    g = torch.Generator(device=DEVICE).manual_seed(tokens * 10 + rank)
    spec = sparse(g, rank, dtype, top_k, round_weights=round_weights)
    h = rand(g, tokens, HIDDEN, dtype=dtype)
    weights, experts = moe.route(h, spec)
    expected = moe.expert_mix(h, weights, experts, spec)
    kind = {torch.float32: "fp32_sum", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    for ordered in (False, True):
        out = kernel_mix(h, weights, experts, spec, ordered)
        assert out.dtype == dtype
        assert_close(out, expected, kind, name=f"routed experts (ordered={ordered})")


def test_an_expert_without_rows_and_every_row_on_one_expert():
    g = torch.Generator(device=DEVICE).manual_seed(5)
    spec = sparse(g, 4, torch.float32)
    h = rand(g, 17, HIDDEN, dtype=torch.float32)
    weights = torch.rand(17, 2, generator=g, device=DEVICE) + 0.1
    spread = torch.arange(34, device=DEVICE).view(17, 2) % 7  # experts 0..6: expert 7 gets no row
    spread[spread == 4] = 5  # nor does expert 4, in the middle of the order
    for experts in (spread, torch.full((17, 2), 3, device=DEVICE)):  # the second: three blocks of one expert
        expected = moe.expert_mix(h, weights, experts, spec)
        for ordered in (False, True):
            assert_close(kernel_mix(h, weights, experts, spec, ordered), expected, "fp32_sum", name="routed experts")


def test_deterministic_mode_depends_only_on_the_inputs():
    # bit for bit run to run, whatever the memory the workspaces are given held before (on CUDA the caching allocator
    # hands the freed NaN-filled blocks to the next run: a read of an unwritten padding row or rank column shows).
    # Four experts: the 27 pairs fill 6 to 8 rows of each expert's 16-row block, and one block of the five unused
    g = torch.Generator(device=DEVICE).manual_seed(7)
    spec = sparse(g, 8, torch.bfloat16, top_k=3, experts=4)
    h = rand(g, 9, HIDDEN, dtype=torch.bfloat16)
    weights, experts = moe.route(h, spec)
    first = kernel_mix(h, weights, experts, spec, ordered=True)
    for fill in (float("nan"), 1e30):
        garbage = [torch.full((1 << 16,), fill, device=DEVICE) for _ in range(8)]
        del garbage
        assert torch.equal(kernel_mix(h, weights, experts, spec, ordered=True), first)


def test_the_kernels_decline_what_they_do_not_take():
    g = torch.Generator(device=DEVICE).manual_seed(9)
    spec = sparse(g, 4, torch.float32)
    h = rand(g, 3, HIDDEN, dtype=torch.float32)
    weights, experts = moe.route(h, spec)
    two_adapters = spec._replace(down=spec.down._replace(loras=spec.down.loras * 2))
    assert moe.fused_expert_mix(h, weights, experts, two_adapters) is None
    assert moe.fused_expert_mix(h.bfloat16(), weights, experts, spec) is None  # input and experts in two dtypes
    # outside a decode step (no step context: a prefill) routed_mlp takes the reference path
    prefill = SimpleNamespace(context=None, ordered=False)
    assert torch.equal(moe.routed_mlp(h, spec, prefill), moe.expert_mix(h, weights, experts, spec))


# -- the engine ------------------------------------------------------------------------------------------------------


def test_engine_greedy_with_the_moe_kernels_matches_generate(monkeypatch):
    from slimrl.rollout.engine import RolloutEngine

    calls = []
    real = moe_kernels.routed_experts
    monkeypatch.setattr(moe_kernels, "routed_experts", lambda *a, **k: calls.append(a[7]) or real(*a, **k))
    # head dim 32: the least the fused attention kernels take; LoRA on attention, router and experts
    model = with_lora(no_eos(build("qwen3_moe", num_attention_heads=2, num_key_value_heads=1, head_dim=32)))
    expected = hf_greedy(model, PROMPTS, 3, eos_token_id=None)  # (on the CPU: helpers builds its inputs there)
    # deterministic: the engine's option reaches the kernels (the atomic path is the kernel tests' default too);
    # no graphs, so that every step's launches are counted on a GPU too
    engine = RolloutEngine(model.to(DEVICE), max_seq_len=32, triton_lora=True, fused_decode=True, deterministic=True,
                           cuda_graphs=False, compile=False)  # fmt: skip
    assert engine.generate(PROMPTS, GREEDY, max_new_tokens=3).completion_ids == expected
    # two sparse layers in each of the two decode steps after the prefill (which runs the reference), ordered
    assert calls == [True] * 4


# -- CUDA ------------------------------------------------------------------------------------------------------------


def qwen3_30b_layer(g):
    """One Qwen3-30B-A3B sparse block (hidden 2048, 128 experts, top-8, expert intermediate 768, renormalised top-k)
    in bf16 with LoRA r=64 as peft's all-linear puts it: rank 128 on gate_up (two projections), 64 on down; LoRA B
    small enough that activations stay O(1), where bf16's absolute rounding is that of the tolerance."""
    return sparse(g, (128, 64), torch.bfloat16, top_k=8, experts=128, hidden=2048, inner=768, b_std=0.02)


@pytest.mark.cuda
def test_qwen3_30b_layer_shape_against_the_reference_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    spec = qwen3_30b_layer(g)
    h = rand(g, 64, 2048, dtype=torch.bfloat16)
    weights, experts = moe.route(h, spec)
    expected = moe.expert_mix(h, weights, experts, spec)  # torch's grouped GEMMs
    for ordered in (False, True):
        # bf16 rows of the eight experts summed: a 1-ulp flip in one of them (GEMM order) shows in the sum
        assert_close(kernel_mix(h, weights, experts, spec, ordered), expected, "bf16_sum", name=f"ordered={ordered}")
    assert torch.equal(kernel_mix(h, weights, experts, spec, True), kernel_mix(h, weights, experts, spec, True))


@pytest.mark.cuda
@pytest.mark.parametrize("ordered", [False, True])
def test_cuda_graph_replays_of_the_routed_experts(ordered):
    g = torch.Generator(device="cuda").manual_seed(1)
    spec = sparse(g, 16, torch.bfloat16, top_k=8, experts=64, hidden=512, inner=192, b_std=0.05)
    decode = SimpleNamespace(context=object(), ordered=ordered)  # a FusedDecode bound to a decode step
    static = rand(g, 32, 512, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the kernels) outside the capture
        moe.routed_mlp(static, spec, decode)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_mlp(static, spec, decode)
    for _ in range(3):  # new tokens, new routing: each replay reads them
        static.copy_(rand(g, 32, 512, dtype=torch.bfloat16))
        graph.replay()
        eager = moe.routed_mlp(static, spec, decode)
        weights, experts = moe.route(static, spec)
        assert_close(out, moe.expert_mix(static, weights, experts, spec), "bf16_sum", name="replay")
        if ordered:
            assert torch.equal(out, eager), "a replay should equal the eager launches bit for bit"
