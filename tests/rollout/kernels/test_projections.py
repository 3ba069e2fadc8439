"""The fused projection kernels' launch variants: spread columns, chosen row tiles, split K."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.model.reference import add_lora_, project, qk_norm_rope, silu_mul
from tests.rollout.kernels.builders import (
    DEVICE,
    DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    RANK,
    bind_step,
    fused_ops,
    make_spec,
    rand,
)
from tests.tolerances import assert_close


@pytest.mark.parametrize("gemm", [True, False])
def test_projection_kernels_with_spread_columns_and_chosen_row_tiles(gemm):
    """Wave-balanced tiles (a program owns fewer columns than its tile holds) and a chosen row tile (16, or 128
    with most of its rows masked) give the same outputs as whole tiles: the masked lanes of each tile compute nothing
    that is stored or shrunk."""
    from slimrl.rollout.kernels import common

    g = torch.Generator(device=DEVICE).manual_seed(4)
    rows, width, dtype = 37, 80, torch.bfloat16
    x = rand(g, rows, HIDDEN, dtype=dtype)
    gate, up = (make_spec(g, width, HIDDEN, dtype, torch.float32, True, True, s) for s in (0.5, 1.5))
    down = make_spec(g, 48, width, dtype, torch.float32, True, True, 0.25)
    outputs = {}
    for label, block_m, per_sm in (("whole", 0, 0), ("spread", 16, 3), ("tall", 128, 0)):
        ops, grouped = fused_ops(gemm, dtype)
        for buckets in ops.choices.values():
            for choice in buckets.values():
                choice.block_m, choice.per_sm = block_m, per_sm
        grouped.begin(rows, 4, RANK, torch.device(DEVICE))
        act = ops.gate_up(x, gate, up, down)
        outputs[label] = (act, ops.linear(act, down, "down"))
    row_blocks = -(-rows // 16)
    cols = common.tile_columns(width, row_blocks, 64, 3, torch.device(DEVICE))
    if DEVICE == "cpu":
        assert cols == 20, "the spread case should leave most of each 64-column tile masked"
    (gate_out, up_out) = project(x, (gate, up), add_lora_)
    want_act = silu_mul(gate_out, up_out)
    for label, (act, down_out) in outputs.items():
        assert_close(act.float(), want_act.float(), "bf16", name=f"silu(gate) * up, {label} tiles")
        (want_down,) = project(act, (down,), add_lora_)
        assert_close(down_out.float(), want_down.float(), "bf16", name=f"down after the fused shrink, {label}")
    if DEVICE == "cpu":  # the interpreter sums each column the same way in any tile (a GPU may pick other MMAs)
        for label in ("spread", "tall"):
            assert torch.equal(outputs["whole"][0], outputs[label][0]), f"the {label} tiling changed gate/up's outputs"


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_launches_match_the_reference_and_leave_the_counts_at_zero(split_k):
    """K shared by several programs per tile (three K steps: shares of 2 + 1, or 1 + 1 + 1): q/k/v with RoPE and
    the cache write, gate/up with the down shrink, and down give the unsplit path's values, twice in a row (each
    tile's last program resets its count for the next launch)."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    # 17 rows: part of one 32-row tile, and two 16-row tiles of the LoRA shrink's producers (the second of one row)
    rows, width, cache_len, column, dtype = 17, 80, 24, 9, torch.bfloat16
    x = rand(g, rows, HIDDEN, dtype=dtype)
    qkv = [make_spec(g, n * DIM, HIDDEN, dtype, torch.float32, True, True, 0.5 + i)
           for i, n in enumerate((HEADS, KV_HEADS, KV_HEADS))]  # fmt: skip
    gate, up = (make_spec(g, width, HIDDEN, dtype, torch.float32, True, True, s) for s in (0.5, 1.5))
    down = make_spec(g, 48, width, dtype, torch.float32, False, True, 0.25)
    angles = torch.rand(rows, DIM // 2, generator=g, device=DEVICE) * 6.0
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))

    q_ref, k_ref, v_ref = project(x, qkv, add_lora_)
    q_ref, k_ref = qk_norm_rope(q_ref.view(rows, HEADS, DIM), k_ref.view(rows, KV_HEADS, DIM), None, None,
                                      cos, sin)  # fmt: skip
    gate_out, up_out = project(x, (gate, up), add_lora_)
    act_ref = silu_mul(gate_out, up_out)

    ops, grouped = fused_ops(True, dtype)
    for buckets in ops.choices.values():
        for choice in buckets.values():
            choice.split_k = split_k
    scratch = ops.new_scratch()
    cache = bind_step(ops, rows, cache_len, column, dtype, scratch)
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
        (want,) = project(act, (down,), add_lora_)
        assert_close(out.float(), want.float(), "bf16", name=f"down, launch {attempt}")
        assert len(scratch._held) == 2, "split-K slots and the producers' chunk slots"
        for _, counts in scratch._held.values():
            assert counts.numel() > 0 and not counts.any(), "a tile's arrival count was left non-zero"
        assert not scratch.state(torch.device(DEVICE)).any(), "a launch left its producer counters set"



@pytest.mark.parametrize("ordered", [False, True])
def test_lora_b_loaded_before_or_after_the_main_loop_gives_the_same_outputs(monkeypatch, ordered):
    """Launches over few rows load their lora_B tiles before the base GEMM's loop (`projections.EARLY_B_ROWS`), others
    after it: where the load happens changes no value. q/k/v with RoPE and the cache write, o, gate/up with down's
    shrink and down, each launch computing its own LoRA shrink as in a decode step, match the reference both ways,
    and in the interpreter bit for bit."""
    from slimrl.rollout.kernels import projections

    g = torch.Generator(device=DEVICE).manual_seed(6)
    rows, width, cache_len, column, dtype = 5, 80, 24, 7, torch.bfloat16
    x = rand(g, rows, HIDDEN, dtype=dtype)
    attn = rand(g, rows, HEADS * DIM, dtype=dtype)
    qkv = [make_spec(g, n * DIM, HIDDEN, dtype, torch.float32, True, True, 0.5 + i)
           for i, n in enumerate((HEADS, KV_HEADS, KV_HEADS))]  # fmt: skip
    o = make_spec(g, HIDDEN, HEADS * DIM, dtype, torch.float32, False, True, 0.75)
    gate, up = (make_spec(g, width, HIDDEN, dtype, torch.float32, True, True, s) for s in (0.5, 1.5))
    down = make_spec(g, 48, width, dtype, torch.float32, False, True, 0.25)
    angles = torch.rand(rows, DIM // 2, generator=g, device=DEVICE) * 6.0
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    q_ref, k_ref, _ = project(x, qkv, add_lora_)
    q_ref, k_ref = qk_norm_rope(q_ref.view(rows, HEADS, DIM), k_ref.view(rows, KV_HEADS, DIM), None, None, cos, sin)
    (o_ref,) = project(attn, (o,), add_lora_)
    act_ref = silu_mul(*project(x, (gate, up), add_lora_))

    results = {}
    for label, early_rows in (("before", rows), ("after", 0)):
        monkeypatch.setattr(projections, "EARLY_B_ROWS", early_rows)
        ops, grouped = fused_ops(True, dtype, ordered=ordered)
        cache = bind_step(ops, rows, cache_len, column, dtype)
        grouped.begin(rows, 4, RANK, torch.device(DEVICE))
        query = ops.qkv(0, x, qkv, None, None, cos, sin)
        o_out = ops.linear(attn, o, "o")
        act = ops.gate_up(x, gate, up, down)
        down_out = ops.linear(act, down, "down")
        assert ops.fuses_shrink("qkv", rows), "the launches should compute their own LoRA shrink, as in a decode step"
        results[label] = (query, cache.keys[0][:, :, column], o_out, act, down_out)
        assert_close(query.float(), q_ref.reshape(rows, -1).float(), "bf16", name=f"q, lora_B {label}")
        assert_close(results[label][1].float(), k_ref.float(), "bf16", name=f"cached k, lora_B {label}")
        assert_close(o_out.float(), o_ref.float(), "bf16", name=f"o, lora_B {label}")
        assert_close(act.float(), act_ref.float(), "bf16", name=f"silu(gate) * up, lora_B {label}")
        (want,) = project(act, (down,), add_lora_)
        assert_close(down_out.float(), want.float(), "bf16", name=f"down, lora_B {label}")
    if DEVICE == "cpu":
        for name, a, b in zip(("q", "k", "o", "act", "down"), results["before"], results["after"], strict=True):
            assert torch.equal(a, b), f"{name} changed with where lora_B was loaded"
