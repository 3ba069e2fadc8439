"""The MLP of the deterministic decode (`FusedDecode(ordered=True)`, the trainers' default).

By default each projection launch of a decode step computes its own LoRA shrink (`gemm.produce_shrink`: K in
chunks added in chunk order, so the same bits in either mode). With separate shrink launches (`KernelChoice.shrink_k`
0, as the prefill's grouped LoRA always runs them) the gate/up kernel does not take the down projection's shrink
in deterministic mode (fp32 shares from every column tile would meet by atomics, and as fixed point they cost more
than a launch of their own: bench/shrink_splits.py); down runs `lora.shrink_(ordered=True)`, whose K splits meet as
fixed point (`common.fixed_add`), or over 65 to 256 rows in per-split slots added in split order. The default mode
keeps the fused fp32 shrink there.

In Triton's interpreter (the CPU) programs run one after another, so these tests pin the arithmetic; the CUDA test
at the end runs the same launches on a GPU, where programs finish in any order, and checks that the bits do not
change."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.kernels import lora as lora_kernels
from slimrl.rollout.kernels import projections
from slimrl.rollout.kv_cache import StepContext
from slimrl.rollout.model.reference import add_lora_, project, silu_mul
from slimrl.rollout.model.views import LinearSpec
from tests.rollout.kernels.builders import DEVICE, HIDDEN, fused_ops, rand, separate_shrinks
from tests.tolerances import assert_close

# 260 intermediate columns: 9 column tiles of 32 (up to 16 rows: groups of 3, 3, 3) or 5 of 64 (17 rows: 3 and 2)
WIDTH, OUT = 260, 48


def lora_spec(g, out_features, in_features, dtype, rank, scale, adapter_dtype=torch.float32):
    """A plain projection with one adapter of `rank` (peft's default: fp32 adapters), bias-free."""
    weight = rand(g, out_features, in_features, dtype=dtype, std=in_features**-0.5)
    lora_a = rand(g, rank, in_features, dtype=adapter_dtype, std=in_features**-0.5)
    lora_b = rand(g, out_features, rank, dtype=adapter_dtype, std=0.05)
    return LinearSpec(None, weight, None, ((lora_a, lora_b, scale),))


def ordered_ops(dtype, rank, rows, block_n=None, fused=False):
    """A deterministic FusedDecode bound to a step (the projections read nothing of it but its split-K scratch);
    block_n: the gate/up kernel's column tile (whole tiles), else the shipped one; fused: the launches compute
    their own shrinks (the shipped default), else `shrink_` launches do."""
    ops, grouped = fused_ops(True, dtype)
    if not fused:
        separate_shrinks(ops.choices)
    ops.ordered = grouped.ordered = True
    if block_n is not None:
        for choice in ops.choices["gate_up"].values():
            choice.block_n, choice.per_sm = block_n, 0
    scratch = ops.new_scratch()
    ops.bind(StepContext(None, None, None, 0, scratch))
    grouped.begin(rows, 4, rank, torch.device(DEVICE))
    return ops, grouped


def counted_shrinks(monkeypatch) -> list:
    """(result, ordered) of every `shrink_` launch (FusedDecode's own groups) from now on."""
    calls = []
    real = lora_kernels.shrink_

    def counted(*args, **kwargs):
        ordered = args[4] if len(args) > 4 else kwargs.get("ordered", False)
        calls.append((real(*args, **kwargs), ordered))
        return calls[-1][0]

    monkeypatch.setattr(lora_kernels, "shrink_", counted)
    return calls


# each row count with both dtypes, each rank with both dtypes (the full product costs three times the interpreter time)
ODD_SHAPES = [(1, 8, torch.float32, "fp32_sum"), (1, 64, torch.bfloat16, "bf16"), (3, 16, torch.float32, "fp32_sum"),
              (3, 8, torch.bfloat16, "bf16"), (17, 64, torch.float32, "fp32_sum"), (17, 16, torch.bfloat16, "bf16")]


@pytest.mark.parametrize("rows, rank, dtype, kind", ODD_SHAPES)
def test_deterministic_mlp_matches_the_reference(monkeypatch, rows, rank, dtype, kind):
    """gate/up, then down with its own fixed-point shrink, against peft's math (fp32 adapters on an fp32 or bf16
    model); down's shrink against act · Aᵀ in fp32, zero past the rank. Rows 1 and 3 fill part of a 16-row tile and
    17 part of a 32-row one."""
    g = torch.Generator(device=DEVICE).manual_seed(100 * rows + rank)
    x = rand(g, rows, HIDDEN, dtype=dtype)
    gate, up = (lora_spec(g, WIDTH, HIDDEN, dtype, rank, s) for s in (0.5, 1.5))
    down = lora_spec(g, OUT, WIDTH, dtype, rank, 0.25)
    shrinks = counted_shrinks(monkeypatch)
    ops, _ = ordered_ops(dtype, rank, rows)
    act = ops.gate_up(x, gate, up, down)
    assert act is not None and ops._shrunk is None, "the deterministic gate/up kernel took down's shrink"
    out = ops.linear(act, down, "down")
    assert out is not None and [o for _, o in shrinks] == [True, True], "gate/up's and down's fixed-point shrinks"

    assert_close(act.float(), silu_mul(*project(x, (gate, up), add_lora_)).float(), kind, name="silu(gate) * up")
    (want,) = project(act, (down,), add_lora_)
    assert_close(out.float(), want.float(), kind, name="down")
    lora_a = down.loras[0][0]
    shrunk = shrinks[1][0][0]
    assert_close(shrunk[:, :rank], act.to(lora_a.dtype).float() @ lora_a.float().t(), "fp32_sum", name="down shrink")
    assert not shrunk[:, rank:].any(), "the shrink past the rank must be zero"
    # the same with the shipped setting: each launch computes its own shrink, with no launch of its own
    shrinks.clear()
    fused, _ = ordered_ops(dtype, rank, rows, fused=True)
    act_fused = fused.gate_up(x, gate, up, down)
    out_fused = fused.linear(act_fused, down, "down")
    assert not shrinks and fused._shrunk is None, "a launch of the fused setting ran or left a shrink"
    assert_close(act_fused.float(), act.float(), kind, name="silu(gate) * up, fused shrinks")
    assert_close(out_fused.float(), want.float(), kind, name="down, fused shrink")


def test_default_gate_up_keeps_the_fused_down_shrink(monkeypatch):
    """The default mode's gate/up launch computes down's shrink (no `shrink_` for down), cast to the adapter's dtype
    as peft casts (bf16 adapters on an fp32 model)."""
    rows, rank, dtype = 3, 8, torch.float32
    g = torch.Generator(device=DEVICE).manual_seed(9)
    x = rand(g, rows, HIDDEN, dtype=dtype)
    gate, up = (lora_spec(g, WIDTH, HIDDEN, dtype, rank, s, torch.bfloat16) for s in (0.5, 1.5))
    down = lora_spec(g, OUT, WIDTH, dtype, rank, 0.25, torch.bfloat16)
    calls = counted_shrinks(monkeypatch)
    ops, grouped = fused_ops(True, dtype)
    grouped.begin(rows, 4, rank, torch.device(DEVICE))
    act = ops.gate_up(x, gate, up, down)
    assert len(calls) == 1 and ops._shrunk is not None, "gate/up should run its own shrink and take down's"
    got = ops.linear(act, down, "down")
    assert len(calls) == 1, "down ran a shrink of its own"
    (want,) = project(act, (down,), add_lora_)
    assert_close(got, want, "bf16", name="down after the fused shrink")



@pytest.mark.parametrize("fused", [True, False])
def test_deterministic_engine_with_fused_kernels_decodes_as_generate(monkeypatch, fused):
    """The engine with fused_decode and deterministic on (the trainers' default) decodes greedily as transformers'
    generate in fp32; no gate/up launch took down's shrink. fused (the shipped settings): a decode step ran a shrink
    launch only for the groups whose setting at its rows asks for one (`shrink_k` 0), the others computed their own;
    else every group ran one. Every shrink ran in a fixed order."""
    from slimrl.rollout.engine import RolloutEngine
    from slimrl.rollout.fused_ops import choices_for
    from tests.rollout.helpers import GREEDY, PROMPTS, build, hf_greedy, no_eos, with_lora

    fused_down = []
    real = projections.project

    def counted(*args, **kwargs):
        if args[6]:  # pair: the gate/up launch
            fused_down.append(kwargs.get("next_shrink") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(projections, "project", counted)
    shrinks = counted_shrinks(monkeypatch)
    # intermediate 160: 5 gate/up column tiles of 32, groups of 3 and 2
    model = no_eos(with_lora(build("qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=160)))  # fmt: skip
    tokens = 3
    expected = hf_greedy(model, PROMPTS, tokens, eos_token_id=None)  # (on the CPU: helpers builds its inputs there)
    # no CUDA graph on a GPU: every decode step then calls the kernels from Python, and is counted
    choices = choices_for(torch.device(DEVICE))[0]
    engine = RolloutEngine(model.to(DEVICE), max_seq_len=64, triton_lora=True, triton_attention=True,
                           fused_decode=True, deterministic=True, cuda_graphs=False, compile=False,
                           kernel_choices=choices if fused else separate_shrinks(choices))  # fmt: skip
    completions = engine.generate(PROMPTS, GREEDY, max_new_tokens=tokens).completion_ids
    assert completions == expected
    steps, layers = tokens - 1, 2  # the first token comes from the prefill
    assert len(fused_down) >= steps * layers and not any(fused_down), "a deterministic gate/up took down's shrink"
    assert all(o for _, o in shrinks), "a shrink was not ordered"
    prefill_rows = max(r.shape[1] for r, _ in shrinks)  # [G, rows, R]; decode steps run fewer (padded) rows
    decode_shrinks = [r for r, _ in shrinks if r.shape[1] < prefill_rows]
    own = [group for group in ("qkv", "o", "gate_up", "down")
           if fused and engine.runner.fused.choice(group, len(PROMPTS)).shrink_k > 0]  # fmt: skip
    assert len(decode_shrinks) == steps * layers * (4 - len(own)), f"decode steps' shrink launches (fused: {own})"


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [8, 64, 256])
@pytest.mark.parametrize("fused", [True, False])
def test_deterministic_decode_at_w1_shape_gives_the_same_bits_every_time(monkeypatch, rows, fused):
    """W1's MLP (hidden 1536, intermediate 8960, LoRA r=64 in fp32 on a bf16 model) on the shipped settings, with
    each launch computing its own shrink (fused, in chunks of 512) or with separate ordered shrink launches:
    gate/up, then down, five times; the programs finish in a different order each time on a GPU, the bits may not
    change. The output is checked against peft's math, and a separate down shrink against act · Aᵀ (TF32)."""
    from slimrl.rollout.fused_ops import FusedDecode, choices_for
    from slimrl.rollout.kernels.lora import GroupedLoRA

    hidden, inter, rank = 1536, 8960, 64
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = rand(g, rows, hidden, dtype=torch.bfloat16)
    gate, up = (lora_spec(g, inter, hidden, torch.bfloat16, rank, 2.0) for _ in range(2))
    down = lora_spec(g, hidden, inter, torch.bfloat16, rank, 2.0)
    calls = counted_shrinks(monkeypatch)
    grouped = GroupedLoRA(tf32=True, ordered=True)
    choices = choices_for(torch.device("cuda"))[0]
    for choice in (c for buckets in choices.values() for c in buckets.values()):
        choice.shrink_k = 512 if fused else 0  # (the shipped settings fuse at some row counts only)
    ops = FusedDecode(12, 2, 128, grouped, tf32=True, ordered=True, choices=choices)
    ops.bind(StepContext(None, None, None, 0, ops.new_scratch()))
    runs = []
    for _ in range(5):
        grouped.begin(rows, 4, rank, torch.device("cuda"))
        act = ops.gate_up(x, gate, up, down)
        out = ops.linear(act, down, "down")
        runs.append((act, out) if fused else (act, out, calls[-1][0][0].clone()))
    assert len(calls) == (0 if fused else 10) and all(o for _, o in calls), "gate/up's and down's shrinks"
    for i, run in enumerate(runs[1:], 1):
        for name, first, again in zip(("act", "down", "down shrink")[: len(run)], runs[0], run, strict=True):
            assert torch.equal(first, again), f"{name}: run {i} gave other bits than run 0"
    (want,) = project(runs[0][0], (down,), add_lora_)
    assert_close(runs[0][1].float(), want.float(), "bf16", name="down")
    if not fused:
        lora_a = down.loras[0][0]
        want = runs[0][0].float() @ lora_a.t()
        error = float((runs[0][2][:, :rank] - want).abs().max() / want.abs().max())
        assert error < 1e-2, f"the down shrink is off by {error:.3g} of its largest magnitude"
