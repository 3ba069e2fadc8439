"""The fused decode kernels (`decode_kernels`, through `fused_decode.FusedDecode`) against the unfused path of
`Decoder.forward_grouped` (peft's LoRA math, transformers' RoPE and Qwen3 norms, the cache's own writes), and the
engine with them on: greedy tokens equal `generate`, and a freed cache does not disturb the next rollout.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout import llama
from slimrl.rollout.kv_cache import StaticKVCache, StepContext, table_entries
from tests.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, KV_HEADS, DIM, HIDDEN, RANK = 4, 2, 32, 96, 8


def rand(g, *shape, dtype, std=1.0):
    return (torch.randn(*shape, generator=g, device=DEVICE) * std).to(dtype)


def make_spec(g, out_features, in_features, dtype, adapter_dtype, bias: bool, lora: bool, scale: float):
    weight = rand(g, out_features, in_features, dtype=dtype, std=in_features**-0.5)
    b = rand(g, out_features, dtype=dtype, std=0.1) if bias else None
    loras = ()
    if lora:
        lora_a = rand(g, RANK, in_features, dtype=adapter_dtype, std=in_features**-0.5)
        lora_b = rand(g, out_features, RANK, dtype=adapter_dtype, std=0.05)
        loras = ((lora_a, lora_b, scale),)
    return llama.LinearSpec(None, weight, b, loras)


def fused_ops(gemm: bool, dtype, head_dim: int = DIM):
    from slimrl.rollout.fused_decode import FusedDecode, default_choices
    from slimrl.rollout.lora_kernels import GroupedLoRA

    choices = default_choices()
    for choice in (c for buckets in choices.values() for c in buckets.values()):
        choice.gemm = gemm
        choice.block_k = 32  # HIDDEN = 96: three K steps, the last one partial for block_k 64
    lora = GroupedLoRA(tf32=False)
    return FusedDecode(HEADS, KV_HEADS, head_dim, lora, tf32=False, choices=choices), lora


CASES = [
    # dtype, adapter dtype, tolerance kind
    (torch.float32, torch.float32, "fp32_sum"),
    (torch.bfloat16, torch.float32, "bf16"),  # peft's default: fp32 adapters on a bf16 model
    (torch.bfloat16, torch.bfloat16, "bf16"),
]


@pytest.mark.parametrize("dtype, adapter_dtype, kind", CASES)
@pytest.mark.parametrize("gemm", [True, False])
@pytest.mark.parametrize(
    "bias, lora, qk_norm, head_dim",
    # head dim 64 without the norm: each head is split over two programs (16 columns of each RoPE half)
    [(True, True, False, DIM), (False, False, True, DIM), (False, True, True, 64), (True, True, False, 64)],
)
def test_qkv_kernel_matches_unfused_projection_norm_rope_and_cache_write(
    dtype, adapter_dtype, kind, gemm, bias, lora, qk_norm, head_dim
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
        norms = tuple(llama.NormSpec(1.0 + rand(g, DIM, dtype=dtype, std=0.1), 1e-6) for _ in range(2))
    angles = torch.rand(rows, DIM // 2, generator=g, device=DEVICE) * 6.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)

    # the reference: the unfused decode path
    cache_ref = StaticKVCache(1, rows, KV_HEADS, cache_len, DIM, dtype, DEVICE)
    q, k, v = llama.project(h, specs, llama.add_lora_)
    q, k = q.view(rows, HEADS, DIM), k.view(rows, KV_HEADS, DIM)
    q, k = llama.qk_norm_rope(q, k, *(norms or (None, None)), cos, sin)
    cache_ref.write_column(0, torch.tensor([column], device=DEVICE), k, v.view(rows, KV_HEADS, DIM))

    ops, grouped = fused_ops(gemm, dtype, head_dim)
    cache = StaticKVCache(1, rows, KV_HEADS, cache_len, DIM, dtype, DEVICE)
    anchor = torch.zeros(1, dtype=dtype, device=DEVICE)
    table = torch.tensor(table_entries(cache, anchor), device=DEVICE)
    ops.bind(StepContext(table, anchor, torch.tensor([column], device=DEVICE), cache_len))
    grouped.begin(rows, 4, RANK, torch.device(DEVICE))
    query = ops.qkv(0, h, specs, *(norms or (None, None)), cos, sin)
    assert query is not None, "the fused kernel refused a layer it should take"
    assert_close(query.float(), q.reshape(rows, -1).float(), kind, name="q")
    assert_close(cache.keys[0].float(), cache_ref.keys[0].float(), kind, name="cached k")
    assert_close(cache.values[0].float(), cache_ref.values[0].float(), kind, name="cached v")
    untouched = torch.ones(cache_len, dtype=torch.bool)
    untouched[column] = False
    assert not cache.keys[0][:, :, untouched].any() and not cache.values[0][:, :, untouched].any()


@pytest.mark.parametrize("dtype, adapter_dtype, kind", CASES)
@pytest.mark.parametrize("gemm", [True, False])
@pytest.mark.parametrize("bias, lora", [(True, True), (False, True), (False, False)])
def test_projection_kernels_match_peft_linear_and_swiglu(dtype, adapter_dtype, kind, gemm, bias, lora, monkeypatch):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    rows, width = 37, 80  # rows over one 32-row tile; width not a multiple of the column tile
    x = rand(g, rows, HIDDEN, dtype=dtype)
    ops, grouped = fused_ops(gemm, dtype)
    grouped.begin(rows, 4, RANK, torch.device(DEVICE))

    down = make_spec(g, width, HIDDEN, dtype, adapter_dtype, bias, lora, 2.0)
    (want,) = llama.project(x, (down,), llama.add_lora_)
    got = ops.linear(x, down, "down")
    assert got is not None
    assert_close(got.float(), want.float(), kind, name="projection")

    gate, up = (make_spec(g, width, HIDDEN, dtype, adapter_dtype, bias, lora, s) for s in (0.5, 1.5))
    gate_out, up_out = llama.project(x, (gate, up), llama.add_lora_)
    want = llama.silu_mul(gate_out, up_out)
    got = ops.gate_up(x, gate, up)
    assert got is not None
    assert_close(got.float(), want.float(), kind, name="silu(gate) * up")

    # with the down projection named, its LoRA shrink rides in the gate/up launch and `linear` picks it up
    down2 = make_spec(g, 48, width, dtype, adapter_dtype, bias, lora, 0.25)
    act = ops.gate_up(x, gate, up, down2)
    (want_down,) = llama.project(act, (down2,), llama.add_lora_)
    from slimrl.rollout import lora_kernels

    shrinks, real_shrink = [], lora_kernels.shrink_
    monkeypatch.setattr(lora_kernels, "shrink_", lambda *a, **k: shrinks.append(1) or real_shrink(*a, **k))
    got_down = ops.linear(act, down2, "down")
    assert got_down is not None and not shrinks, "the down projection ran its own shrink"
    assert_close(got_down.float(), want_down.float(), kind, name="down after the fused shrink")


@pytest.mark.parametrize("gemm", [True, False])
def test_projection_kernels_with_spread_columns_and_chosen_row_tiles(gemm):
    """Wave-balanced tiles (a program owns fewer columns than its tile holds) and a chosen row tile give the same
    outputs as whole tiles: the masked lanes of each tile compute nothing that is stored or shrunk."""
    from slimrl.rollout import decode_kernels

    g = torch.Generator(device=DEVICE).manual_seed(4)
    rows, width, dtype = 37, 80, torch.bfloat16
    x = rand(g, rows, HIDDEN, dtype=dtype)
    gate, up = (make_spec(g, width, HIDDEN, dtype, torch.float32, True, True, s) for s in (0.5, 1.5))
    down = make_spec(g, 48, width, dtype, torch.float32, True, True, 0.25)
    outputs = {}
    for label, block_m, per_sm in (("whole", 0, 0), ("spread", 16, 3)):
        ops, grouped = fused_ops(gemm, dtype)
        for buckets in ops.choices.values():
            for choice in buckets.values():
                choice.block_m, choice.per_sm = block_m, per_sm
        grouped.begin(rows, 4, RANK, torch.device(DEVICE))
        act = ops.gate_up(x, gate, up, down)
        outputs[label] = (act, ops.linear(act, down, "down"))
    row_blocks = -(-rows // 16)
    cols = decode_kernels.tile_columns(width, row_blocks, 64, 3, torch.device(DEVICE))
    if DEVICE == "cpu":
        assert cols == 20, "the spread case should leave most of each 64-column tile masked"
    (gate_out, up_out) = llama.project(x, (gate, up), llama.add_lora_)
    want_act = llama.silu_mul(gate_out, up_out)
    for label, (act, down_out) in outputs.items():
        assert_close(act.float(), want_act.float(), "bf16", name=f"silu(gate) * up, {label} tiles")
        (want_down,) = llama.project(act, (down,), llama.add_lora_)
        assert_close(down_out.float(), want_down.float(), "bf16", name=f"down after the fused shrink, {label}")
    if DEVICE == "cpu":  # the interpreter sums each column the same way in any tile (a GPU may pick other MMAs)
        assert torch.equal(outputs["whole"][0], outputs["spread"][0]), "the tiling changed the gate/up outputs"


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_launches_match_the_reference_and_leave_the_counts_at_zero(split_k):
    """K shared by several programs per tile (three K steps: shares of 2 + 1, or 1 + 1 + 1): q/k/v with RoPE and
    the cache write, gate/up with the down shrink, and down give the unsplit path's values, twice in a row (each
    tile's last program resets its count for the next launch)."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    rows, width, cache_len, column, dtype = 37, 80, 24, 9, torch.bfloat16
    x = rand(g, rows, HIDDEN, dtype=dtype)
    qkv = [make_spec(g, n * DIM, HIDDEN, dtype, torch.float32, True, True, 0.5 + i)
           for i, n in enumerate((HEADS, KV_HEADS, KV_HEADS))]  # fmt: skip
    gate, up = (make_spec(g, width, HIDDEN, dtype, torch.float32, True, True, s) for s in (0.5, 1.5))
    down = make_spec(g, 48, width, dtype, torch.float32, False, True, 0.25)
    angles = torch.rand(rows, DIM // 2, generator=g, device=DEVICE) * 6.0
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))

    q_ref, k_ref, v_ref = llama.project(x, qkv, llama.add_lora_)
    q_ref, k_ref = llama.qk_norm_rope(q_ref.view(rows, HEADS, DIM), k_ref.view(rows, KV_HEADS, DIM), None, None,
                                      cos, sin)  # fmt: skip
    gate_out, up_out = llama.project(x, (gate, up), llama.add_lora_)
    act_ref = llama.silu_mul(gate_out, up_out)

    ops, grouped = fused_ops(True, dtype)
    for buckets in ops.choices.values():
        for choice in buckets.values():
            choice.split_k = split_k
    scratch = ops.new_scratch()
    cache = StaticKVCache(1, rows, KV_HEADS, cache_len, DIM, dtype, DEVICE)
    anchor = torch.zeros(1, dtype=dtype, device=DEVICE)
    table = torch.tensor(table_entries(cache, anchor), device=DEVICE)
    ops.bind(StepContext(table, anchor, torch.tensor([column], device=DEVICE), cache_len, scratch))
    for attempt in range(2):
        grouped.begin(rows, 4, RANK, torch.device(DEVICE))
        query = ops.qkv(0, x, qkv, None, None, cos, sin)
        act = ops.gate_up(x, gate, up, down)
        out = ops.linear(act, down, "down")
        assert query is not None and act is not None and out is not None
        assert_close(query.float(), q_ref.reshape(rows, -1).float(), "bf16", name=f"q, launch {attempt}")
        assert_close(cache.keys[0][:, :, column].float(), k_ref.float(), "bf16", name=f"cached k, launch {attempt}")
        assert_close(cache.values[0][:, :, column].float(), v_ref.view(rows, KV_HEADS, DIM).float(), "bf16",
                     name=f"cached v, launch {attempt}")  # fmt: skip
        assert_close(act.float(), act_ref.float(), "bf16", name=f"silu(gate) * up, launch {attempt}")
        (want,) = llama.project(act, (down,), llama.add_lora_)
        assert_close(out.float(), want.float(), "bf16", name=f"down, launch {attempt}")
        (held,) = scratch._held.values()
        assert held[1].numel() > 0 and not held[1].any(), "a tile's arrival count was left non-zero"


@pytest.mark.parametrize(
    "dtype, weight_dtype, kind",
    [(torch.float32, torch.float32, "fp32_sum"), (torch.bfloat16, torch.bfloat16, "bf16"),
     (torch.bfloat16, torch.float32, "bf16")],
)  # fmt: skip
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_kernel_matches_the_eager_norm(dtype, weight_dtype, kind, add):
    from slimrl.rollout import decode_kernels

    g = torch.Generator(device=DEVICE).manual_seed(4)
    hidden = rand(g, 5, HIDDEN, dtype=dtype, std=3.0)
    delta = rand(g, 5, HIDDEN, dtype=dtype) if add else None
    weight = (1.0 + rand(g, HIDDEN, dtype=torch.float32, std=0.2)).to(weight_dtype)
    before = hidden.clone()
    got_hidden, got = decode_kernels.add_rms_norm(hidden, delta, weight, 1e-5)
    if add:
        want_hidden, want = llama.add_rms_norm(hidden, delta, weight, 1e-5)
    else:
        want_hidden, want = hidden, llama.rms_norm(hidden, weight, 1e-5)
    assert torch.equal(hidden, before), "the input hidden state was changed"
    assert torch.equal(got_hidden, want_hidden)  # one rounding of an fp32 sum, as eager
    assert got.dtype == want.dtype
    assert_close(got.float(), want.float(), kind, name="normed")


def test_programmatic_dependent_launch_only_where_the_device_has_it(monkeypatch):
    from slimrl.rollout import pdl

    # Triton's interpreter and CPU tensors have no grid dependency control: the kernels launch as usual there
    assert pdl.options(torch.device("cpu")) == {"PDL": 0, "launch_pdl": False}
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl.options(torch.device("cuda"))["launch_pdl"] == (hopper and pdl._HAVE_GDC)
        monkeypatch.setattr(pdl, "MODE", 0)  # SLIMRL_PDL=0
        assert pdl.options(torch.device("cuda")) == {"PDL": 0, "launch_pdl": False}


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
    assert ops.add_rms_norm(x, x, llama.NormSpec(x[0], 1e-5)) is None  # the prefill keeps its compiled norms


def test_attention_kernel_reads_the_cache_through_the_table():
    from slimrl.rollout.attention_kernel import decode_attention

    g = torch.Generator(device=DEVICE).manual_seed(3)
    q = rand(g, 3, HEADS, DIM, dtype=torch.float32)
    cache = StaticKVCache(2, 3, KV_HEADS, 40, DIM, torch.float32, DEVICE)
    for t in (*cache.keys, *cache.values):
        t.copy_(rand(g, *t.shape, dtype=torch.float32))
    keys, values = cache.keys, cache.values
    anchor = torch.zeros(1, device=DEVICE)
    table = torch.tensor(table_entries(cache, anchor), device=DEVICE)
    starts, end = torch.tensor([0, 3, 20], device=DEVICE), torch.tensor([30], device=DEVICE)
    direct = decode_attention(q, keys[1], values[1], starts, end, DIM**-0.5)
    shape_only = torch.empty_like(keys[0])  # only its shape and strides are used
    via_table = decode_attention(q, shape_only, shape_only, starts, end, DIM**-0.5, 1, table, anchor)
    assert torch.equal(via_table, direct)


@pytest.mark.parametrize(("arch", "deterministic"), [("llama", False), ("qwen2", False), ("qwen3", False),
                                                     ("llama", True)])  # fmt: skip
def test_engine_with_fused_kernels_decodes_as_generate(arch, deterministic, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from slimrl.rollout import decode_kernels

    launches = {"qkv": 0, "project": 0}
    for name, attr in (("qkv", "qkv_rope_cache"), ("project", "project")):
        original = getattr(decode_kernels, attr)

        def counted(*args, _original=original, _name=name, **kwargs):
            launches[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(decode_kernels, attr, counted)

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
    engine = RolloutEngine(model, max_seq_len=64, grouped_decode=True, triton_attention=True, fused_decode=True,
                           deterministic=deterministic)  # fmt: skip
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    first = engine.generate(prompts, params, max_new_tokens=6)
    engine.release()  # frees the cache; the next rollout allocates a new one at another address
    blocker = torch.ones(1 << 16, device=DEVICE)  # noqa: F841 - keeps the old cache's memory from being reused
    second = engine.generate(prompts, params, max_new_tokens=6)
    assert first.completion_ids == second.completion_ids
    if DEVICE == "cpu":
        steps = 2 * 5  # two rollouts of 6 tokens: the first token comes from the prefill
        # decode: q/k/v, o, gate/up and down of both layers each step; prefill: o, gate/up and down epilogues
        expected = {"qkv": 2 * steps, "project": 3 * 2 * steps + 2 * 3 * 2}
        assert launches == expected, "every decode layer ran the fused kernels"
    else:  # a captured graph: the kernels were launched while capturing, and the graph outlived the freed cache
        assert launches["qkv"] > 0 and launches["project"] > 0
        assert engine._session.graph is not None and not engine._session.graph_bakes_cache
        assert second.stats.get("captures", 0) == 0, "the second rollout captured again"
    for prompt, completion in zip(prompts, first.completion_ids, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                      eos_token_id=None)  # fmt: skip
        assert completion == expected[0, len(prompt) :].tolist()
