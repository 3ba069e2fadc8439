"""The fused decode kernels (`kernels.projections`, through `fused_ops.FusedDecode`) against the unfused path of
`Decoder.forward` (peft's LoRA math, transformers' RoPE and Qwen3 norms, the cache's own writes), and the
engine with them on: greedy tokens equal `generate`, and a freed cache does not disturb the next rollout.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kernels.gemm import SplitScratch
from slimrl.rollout.kv_cache import StaticKVCache, StepContext, table_entries
from slimrl.rollout.model.reference import add_lora_, project, qk_norm_rope, silu_mul
from slimrl.rollout.model.views import NormSpec
from tests.rollout.kernels.builders import DEVICE, DIM, HEADS, HIDDEN, KV_HEADS, RANK, fused_ops, make_spec, rand
from tests.tolerances import assert_close

CASES = [
    # dtype, adapter dtype, tolerance kind
    (torch.float32, torch.float32, "fp32_sum"),
    (torch.bfloat16, torch.float32, "bf16"),  # peft's default: fp32 adapters on a bf16 model
    (torch.bfloat16, torch.bfloat16, "bf16"),
]


def counted_shrinks(monkeypatch) -> list:
    """A list that grows by one at each `lora.shrink_` launch from now on."""
    from slimrl.rollout.kernels import lora as lora_kernels

    shrinks, real_shrink = [], lora_kernels.shrink_
    monkeypatch.setattr(lora_kernels, "shrink_", lambda *a, **k: shrinks.append(1) or real_shrink(*a, **k))
    return shrinks


@pytest.mark.parametrize("dtype, adapter_dtype, kind", CASES)
@pytest.mark.parametrize("gemm", [True, False])
@pytest.mark.parametrize(
    "bias, lora, qk_norm, head_dim, fused_shrink",
    # head dim 64 without the norm: each head is split over two programs (16 columns of each RoPE half);
    # fused_shrink: the launch computes lora_A(h) itself (`gemm.produce_shrink`), else a `shrink_` launch does
    [(True, True, False, DIM, True), (True, True, False, DIM, False), (False, False, True, DIM, True),
     (False, True, True, 64, True), (True, True, False, 64, False)],
)  # fmt: skip
def test_qkv_kernel_matches_unfused_projection_norm_rope_and_cache_write(
    dtype, adapter_dtype, kind, gemm, bias, lora, qk_norm, head_dim, fused_shrink, monkeypatch
):
    DIM = head_dim  # noqa: N806 - the module constant, overridden for this case
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows, cache_len, column = 5, 24, 17
    specs = [
        make_spec(g, n * DIM, HIDDEN, dtype, adapter_dtype, bias, lora, 0.5 + i)
        for i, n in enumerate((HEADS, KV_HEADS, KV_HEADS))
    ]
    h = rand(g, rows, HIDDEN, dtype=dtype)
    norms = None
    if qk_norm:
        norms = tuple(NormSpec(1.0 + rand(g, DIM, dtype=dtype, std=0.1), 1e-6) for _ in range(2))
    angles = torch.rand(rows, DIM // 2, generator=g, device=DEVICE) * 6.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)

    # the reference: the unfused decode path
    cache_ref = StaticKVCache(1, rows, KV_HEADS, cache_len, DIM, dtype, DEVICE)
    q, k, v = project(h, specs, add_lora_)
    q, k = q.view(rows, HEADS, DIM), k.view(rows, KV_HEADS, DIM)
    q, k = qk_norm_rope(q, k, *(norms or (None, None)), cos, sin)
    cache_ref.write_column(0, torch.tensor([column], device=DEVICE), k, v.view(rows, KV_HEADS, DIM))

    ops, grouped = fused_ops(gemm, dtype, head_dim)
    cache = StaticKVCache(1, rows, KV_HEADS, cache_len, DIM, dtype, DEVICE)
    anchor = torch.zeros(1, dtype=dtype, device=DEVICE)
    table = torch.tensor(table_entries(cache, anchor), device=DEVICE)
    scratch = SplitScratch()
    ops.bind(StepContext(table, anchor, torch.tensor([column], device=DEVICE), cache_len, scratch))
    if not fused_shrink:
        ops.choices["qkv"][16].shrink_k = 0
    grouped.begin(rows, 4, RANK, torch.device(DEVICE))
    shrinks = counted_shrinks(monkeypatch)
    query = ops.qkv(0, h, specs, *(norms or (None, None)), cos, sin)
    assert query is not None, "the fused kernel refused a layer it should take"
    assert len(shrinks) == (1 if lora and not fused_shrink else 0)
    assert not scratch.state(torch.device(DEVICE)).any(), "the launch left its producer counters set"
    assert_close(query.float(), q.reshape(rows, -1).float(), kind, name="q")
    assert_close(cache.keys[0].float(), cache_ref.keys[0].float(), kind, name="cached k")
    assert_close(cache.values[0].float(), cache_ref.values[0].float(), kind, name="cached v")
    untouched = torch.ones(cache_len, dtype=torch.bool)
    untouched[column] = False
    assert not cache.keys[0][:, :, untouched].any() and not cache.values[0][:, :, untouched].any()


@pytest.mark.parametrize("dtype, adapter_dtype, kind", CASES)
@pytest.mark.parametrize("gemm", [True, False])
# shrink_k: a `shrink_` launch (0), or the launch's own producers in chunks of 64 inputs (two, the last partial) or
# one over all of them (what a capture that finds the chunks' slots too small falls back to); without LoRA there is no
# shrink to produce: 0, and 64 for a step context with nothing to produce
@pytest.mark.parametrize("bias, lora, shrink_k", [(bias, True, k) for bias in (True, False) for k in (0, 64, 4096)]
                         + [(False, False, 0), (False, False, 64)])  # fmt: skip
def test_projection_kernels_match_peft_linear_and_swiglu(dtype, adapter_dtype, kind, gemm, bias, lora, shrink_k,
                                                         monkeypatch):  # fmt: skip
    fused_shrink = shrink_k > 0
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows, width = 37, 80  # rows over one 32-row tile; width not a multiple of the column tile
    x = rand(g, rows, HIDDEN, dtype=dtype)
    ops, grouped = fused_ops(gemm, dtype)
    for choice in (c for buckets in ops.choices.values() for c in buckets.values()):
        choice.shrink_k = shrink_k
    grouped.begin(rows, 4, RANK, torch.device(DEVICE))
    scratch = None
    if fused_shrink:  # a decode step's context: each launch computes lora_A(x) itself
        scratch = SplitScratch()
        zero = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        ops.bind(StepContext(zero, torch.zeros(1, dtype=dtype, device=DEVICE), zero, 1, scratch))
    shrinks = counted_shrinks(monkeypatch)

    down = make_spec(g, width, HIDDEN, dtype, adapter_dtype, bias, lora, 2.0)
    (want,) = project(x, (down,), add_lora_)
    got = ops.linear(x, down, "down")
    assert got is not None
    assert_close(got.float(), want.float(), kind, name="projection")

    gate, up = (make_spec(g, width, HIDDEN, dtype, adapter_dtype, bias, lora, s) for s in (0.5, 1.5))
    gate_out, up_out = project(x, (gate, up), add_lora_)
    want = silu_mul(gate_out, up_out)
    got = ops.gate_up(x, gate, up)
    assert got is not None
    assert_close(got.float(), want.float(), kind, name="silu(gate) * up")

    assert len(shrinks) == (2 if lora and not fused_shrink else 0)

    # with the down projection named, its LoRA shrink rides in the gate/up launch and `linear` picks it up (or, in a
    # step whose launches compute their own shrinks, the down launch does)
    down2 = make_spec(g, 48, width, dtype, adapter_dtype, bias, lora, 0.25)
    act = ops.gate_up(x, gate, up, down2)
    (want_down,) = project(act, (down2,), add_lora_)
    shrinks.clear()
    got_down = ops.linear(act, down2, "down")
    assert got_down is not None and not shrinks, "the down projection ran a shrink launch"
    assert_close(got_down.float(), want_down.float(), kind, name="down after the fused shrink")
    if scratch is not None:
        assert not scratch.state(torch.device(DEVICE)).any(), "a launch left its producer counters set"


def test_fused_ops_refuse_what_they_cannot_take():
    g = torch.Generator(device=DEVICE).manual_seed(2)
    ops, grouped = fused_ops(True, torch.float32)
    x = rand(g, 3, HIDDEN, dtype=torch.float32)
    grouped.begin(3, 4, RANK, torch.device(DEVICE))
    plain = make_spec(g, 64, HIDDEN, torch.float32, torch.float32, False, False, 1.0)
    adapted = make_spec(g, 64, HIDDEN, torch.float32, torch.float32, False, True, 1.0)
    two = adapted._replace(loras=adapted.loras * 2)
    assert ops.gate_up(x, plain, adapted) is None  # one with LoRA, one without
    assert ops.linear(x, two) is None  # two active adapters: peft sums them in the adapter dtype
    assert ops.qkv(0, x, (adapted, adapted, adapted), None, None, None, None) is None  # no step bound
    assert ops.add_rms_norm(x, x, NormSpec(x[0], 1e-5)) is None  # the prefill keeps its compiled norms


@pytest.mark.parametrize(("arch", "deterministic"), [("llama", False), ("qwen2", False), ("qwen3", False),
                                                     ("llama", True)])  # fmt: skip
def test_engine_with_fused_kernels_decodes_as_generate(arch, deterministic, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from slimrl.rollout.kernels import projections

    launches = {"qkv": 0, "project": 0}
    for name, attr in (("qkv", "qkv_rope_cache"), ("project", "project")):
        original = getattr(projections, attr)

        def counted(*args, _original=original, _name=name, **kwargs):
            launches[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(projections, attr, counted)

    from transformers import AutoModelForCausalLM, Qwen3Config

    from slimrl.rollout.engine import RolloutEngine
    from slimrl.rollout.sampling import SamplingParams
    from slimrl.testing import tiny_config, tiny_model

    shape = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # head dim 32: the kernels' least
    if arch == "qwen3":
        config = Qwen3Config(**{**tiny_config("llama", **shape).to_dict(), "head_dim": DIM})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = tiny_model(arch, **shape)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    model = model.to(DEVICE)
    prompts = [[5, 9, 11, 4, 7, 8], [6, 12, 3], [9, 9, 10, 2]]
    engine = RolloutEngine(model, max_seq_len=64, triton_lora=True, triton_attention=True, fused_decode=True,
                           deterministic=deterministic)  # fmt: skip
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    tokens = 3  # the prefill gives the first; decode step 2 reads the cache column that step 1 wrote
    first = engine.generate(prompts, params, max_new_tokens=tokens)
    engine.release()  # frees the cache; the next rollout allocates a new one at another address
    blocker = torch.ones(1 << 16, device=DEVICE)  # noqa: F841 - keeps the old cache's memory from being reused
    second = engine.generate(prompts, params, max_new_tokens=tokens)
    assert first.completion_ids == second.completion_ids
    if DEVICE == "cpu":
        steps = 2 * (tokens - 1)  # two rollouts: the first token of each comes from the prefill
        # decode: q/k/v, o, gate/up and down of both layers each step; prefill: o, gate/up and down epilogues
        expected = {"qkv": 2 * steps, "project": 3 * 2 * steps + 2 * 3 * 2}
        assert launches == expected, "every decode layer ran the fused kernels"
    else:  # a captured graph: the kernels were launched while capturing, and the graph outlived the freed cache
        assert launches["qkv"] > 0 and launches["project"] > 0
        assert engine.describe()["graph_captured"] and not engine.sessions.current.graph_bakes_cache
        assert second.stats.get("captures", 0) == 0, "the second rollout captured again"
    for prompt, completion in zip(prompts, first.completion_ids, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                      do_sample=False, eos_token_id=None)  # fmt: skip
        assert completion == expected[0, len(prompt) :].tolist()

