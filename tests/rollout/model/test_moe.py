"""Qwen3-MoE and Mixtral through the engine: the routed MLP against transformers' sparse block, and greedy rollouts
against `generate` with live LoRA on attention, router and experts (tiny models, 4 experts, top-2, fp32)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.model import moe
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.model.views import supports
from tests.rollout.helpers import GREEDY, PROMPTS, build, hf_greedy, no_eos, step_the_adapter, with_lora
from tests.rollout.kernels.builders import DEVICE
from tests.tolerances import assert_close

ATTENTION_AND_ROUTER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate"]  # peft puts "gate" on the router weight


def lora(model, targets, seed: int = 1):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def first_block(model):
    return model.get_base_model().model.layers[0].mlp if hasattr(model, "get_base_model") else model.model.layers[0].mlp


# -- the routed MLP --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("targets", [None, ["gate"], "all-linear"])
def test_routed_mlp_equals_the_sparse_block(arch, targets):
    model = build(arch) if targets is None else lora(build(arch), targets).eval()
    block = first_block(model)
    assert moe.is_sparse_block(block) and moe.sparse_problem(block) is None
    spec = moe.sparse_spec(block)
    assert len(spec.gate_up.loras) == len(spec.down.loras) == (targets == "all-linear")
    h = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(moe.routed_mlp(h, spec), block(h[None])[0], name=f"{arch} block output")
        if targets is not None:  # the adapter reaches the routing: other experts win for some tokens
            base = spec._replace(router=block.gate.get_base_layer().weight)
            assert not torch.equal(moe.route(h, spec)[1], moe.route(h, base)[1])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routed_mlp_in_bf16_keeps_each_architectures_routing_weight_dtype(arch):
    # Qwen3-MoE rounds the routing weights to bf16 before weighting the experts' outputs, Mixtral keeps them in fp32
    model = lora(build(arch), ATTENTION_AND_ROUTER).eval().to(torch.bfloat16)
    block = first_block(model)
    h = torch.randn(29, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    spec = moe.sparse_spec(block)
    with torch.no_grad():
        ours, theirs = moe.routed_mlp(h, spec), block(h[None])[0]
        other = moe.routed_mlp(h, spec._replace(round_weights=not spec.round_weights))
    assert_close(ours, theirs, "exact", name=f"{arch} bf16 block output")  # the same GEMMs as transformers
    assert not torch.equal(other, theirs), "the routing weights' dtype should show in bf16"


def test_the_three_grouped_gemms_agree_with_per_expert_linear():
    gen = torch.Generator().manual_seed(0)
    experts = torch.tensor([0, 0, 0, 2, 2, 3, 3, 3, 3])  # expert 1 has no rows
    x, weight = torch.randn(9, 16, generator=gen), torch.randn(4, 8, 16, generator=gen)
    groups = moe.Groups(torch.tensor([3, 3, 5, 9], dtype=torch.int32), experts)
    expected = torch.stack([x[i] @ weight[e].T for i, e in enumerate(experts.tolist())])
    assert moe.grouped_mm_fits(x, weight)
    for form in (moe.grouped_linear, moe.expert_loop, moe.masked_experts):
        assert_close(form(x, weight, groups), expected, name=form.__name__)


# -- the engine ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "overrides", "targets"),
    [
        ("qwen3_moe", {}, "all-linear"),  # attention, router and experts
        ("mixtral", {}, ATTENTION_AND_ROUTER),  # the experts without an adapter
        ("qwen3_moe", {"mlp_only_layers": [1]}, "all-linear"),  # a sparse then a dense layer
    ],
)
def test_greedy_with_lora_matches_generate(arch, overrides, targets):
    model = lora(no_eos(build(arch, **overrides)), targets).eval()
    layers = model.get_base_model().model.layers
    assert [moe.is_sparse_block(layer.mlp) for layer in layers] == [True, not overrides]
    expert_lora = moe.sparse_spec(layers[0].mlp).gate_up.loras
    assert len(expert_lora) == (targets == "all-linear")
    engine = RolloutEngine(model)
    out = engine.generate(PROMPTS, GREEDY, max_new_tokens=12).completion_ids
    assert out == hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    with model.disable_adapter():  # the same engine sees the base weights
        base = engine.generate(PROMPTS, GREEDY, max_new_tokens=12).completion_ids
        assert base == hf_greedy(model, PROMPTS, 12, eos_token_id=None)
    assert base != out, "the adapter should change the greedy output"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_an_optimizer_step_on_router_and_expert_adapters_reaches_the_next_rollout(arch):
    model = with_lora(no_eos(build(arch)))
    engine = RolloutEngine(model)
    before = engine.generate(PROMPTS, GREEDY, max_new_tokens=8).completion_ids
    # only the sparse blocks' adapters move (all-linear puts LoRA on the router and the experts)
    step_the_adapter(model, lr=50.0, keep=lambda name: ".mlp." in name)
    after = engine.generate(PROMPTS, GREEDY, max_new_tokens=8).completion_ids
    assert after == hf_greedy(model, PROMPTS, 8, eos_token_id=None)
    assert after != before


def test_fingerprint_is_stable_and_covers_the_expert_tensors():
    model = with_lora(build("mixtral"))
    decoder = Decoder(model)
    first = decoder.fingerprint()
    assert decoder.fingerprint() == first  # no per-call tensor (folded router, permuted LoRA B) in it
    experts = first_block(model).experts.get_base_layer()
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().clone())
    assert decoder.fingerprint() != first
    enabled = decoder.fingerprint()
    with model.disable_adapter():  # the adapters' factors leave what the graph reads
        assert decoder.fingerprint() != enabled


def test_supports_refuses_a_sparse_block_it_does_not_implement():
    model = build("mixtral")
    model.model.layers[1].mlp.gate = torch.nn.Linear(64, 4, bias=False)  # a router of another kind
    ok, why = supports(model)
    assert not ok and "layer 1" in why and "router Linear" in why


def test_qwen3_moe_renormalised_top_k_and_a_rank_padded_for_the_grouped_gemm():
    # norm_topk_prob=True (Qwen3-30B-A3B's setting); rank 2 in fp32 is 8 bytes a row: padded with zero ranks
    model = build("qwen3_moe", norm_topk_prob=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = get_peft_model(model, LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False)).eval()
    block = first_block(model)
    spec = moe.sparse_spec(block)
    assert spec.normalize and spec.gate_up.loras[0][0].shape[1] == 4
    h = torch.randn(23, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(moe.routed_mlp(h, spec), block(h[None])[0], name="renormalised block output")


def test_fused_decode_runs_attention_kernels_and_the_routed_experts(monkeypatch):
    # on CPU the Triton kernels run in the interpreter (tests/conftest.py), on a GPU machine compiled (the model on
    # the GPU, fp32 without TF32: the same greedy tokens); head dim 32 is the kernels' least
    from slimrl.rollout.fused_ops import FusedDecode
    from slimrl.rollout.kernels import projections, router

    calls = {"qkv": 0, "gate_up": 0, "route": 0}
    real_qkv, real_gate_up, real_route = projections.qkv_rope_cache, FusedDecode.gate_up, router.route
    monkeypatch.setattr(router, "route", lambda *a, **k: calls.update(route=calls["route"] + 1) or real_route(*a, **k))
    monkeypatch.setattr(projections, "qkv_rope_cache", lambda *a, **k: calls.update(qkv=calls["qkv"] + 1) or
                        real_qkv(*a, **k))  # fmt: skip
    monkeypatch.setattr(FusedDecode, "gate_up", lambda *a, **k: calls.update(gate_up=calls["gate_up"] + 1) or
                        real_gate_up(*a, **k))  # fmt: skip
    model = with_lora(no_eos(build("qwen3_moe", num_attention_heads=2, num_key_value_heads=1, head_dim=32)))
    model.to(DEVICE)
    engine = RolloutEngine(model, max_seq_len=64, triton_lora=True, triton_attention=True, fused_decode=True)
    out = engine.generate(PROMPTS, GREEDY, max_new_tokens=5).completion_ids
    assert out == hf_greedy(model, PROMPTS, 5, eos_token_id=None)
    # the routers of the decode steps' sparse blocks ran as the fused kernel (the prefill's as the reference)
    assert calls["qkv"] > 0 and calls["gate_up"] == 0 and calls["route"] == calls["qkv"], calls


# -- the experts' LoRA factors staged once per rollout --------------------------------------------------------------


def test_staged_factors_are_refreshed_in_place_once_per_rollout():
    model = with_lora(build("qwen3_moe"))
    wrapper = next(w for w in moe._unwrap(first_block(model).experts)[1] if w.parameter_name == "gate_up_proj")
    ((lora_a, lora_b, _),) = moe._active_factors(wrapper)
    experts, staged = wrapper.num_experts, moe.StagedFactors()
    with torch.no_grad():  # as the engine's generate runs it
        staged.begin()
        a, b = staged.factors(lora_a, lora_b, experts, torch.bfloat16)
        fresh = moe.expert_layout(lora_a, lora_b, experts, torch.bfloat16)
        assert torch.equal(a, fresh[0]) and torch.equal(b, fresh[1]) and b.dtype == torch.bfloat16
        lora_b.mul_(-3.0)  # an optimizer step between rollouts
        same = staged.factors(lora_a, lora_b, experts, torch.bfloat16)[1]
        assert same is b and torch.equal(same, fresh[1]), "within a rollout the layout is not redone"
        staged.begin()
        again = staged.factors(lora_a, lora_b, experts, torch.bfloat16)[1]
        assert again.data_ptr() == b.data_ptr(), "refreshed in place: a captured graph keeps reading it"
        assert torch.equal(again, moe.expert_layout(lora_a, lora_b, experts, torch.bfloat16)[1])
        assert not torch.equal(again, fresh[1])
        identity = staged.identity()
        staged.clear()
        staged.factors(lora_a, lora_b, experts, torch.bfloat16)
        assert len(staged.identity()) == len(identity) == 2  # the A and B buffers' addresses


def test_the_engine_stages_during_generate_and_release_frees_them():
    model = with_lora(no_eos(build("qwen3_moe")))
    engine = RolloutEngine(model)
    engine.generate(PROMPTS, GREEDY, max_new_tokens=4)
    layers = model.config.num_hidden_layers
    # per layer: gate_up's and down's factors and the router's folded weight
    assert engine.decoder.staged is None and len(engine.staged.entries) == 3 * layers
    engine.release()
    assert not engine.staged.entries


@pytest.mark.cuda
def test_cuda_graph_replays_read_the_staged_factors_after_in_place_updates():
    # fp32 on CUDA (exact greedy against generate): the captured decode graph bakes the staged buffers' addresses;
    # each rollout refreshes them in place, before any replay, so an optimizer step reaches the next rollout
    import os

    model = with_lora(no_eos(build("qwen3_moe", num_attention_heads=2, num_key_value_heads=1, head_dim=32))).cuda()
    engine = RolloutEngine(model, max_seq_len=64, compile=os.environ.get("TRITON_INTERPRET", "0") != "1")
    assert engine.options.cuda_graphs
    outs = []
    for release in (False, True, False):
        out = engine.generate(PROMPTS, GREEDY, max_new_tokens=10).completion_ids
        assert out == hf_greedy(model, PROMPTS, 10, eos_token_id=None)
        outs.append(out)
        with torch.no_grad():  # in place, as an optimizer step on the experts' adapters
            for name, param in model.named_parameters():
                if "lora_B" in name and ".experts" in name:
                    param.mul_(-2.0)
        if release:
            engine.release()
    assert outs[0] != outs[1] != outs[2]
