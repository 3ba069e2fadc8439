"""bench/rollout.py (W2) with the tiny W1-family model: every section that runs without CUDA records what W2 reports,
the previous script's command lines still parse, a --variants entry becomes the flags and kernel settings it names,
and a failed check or a raising section is recorded and makes the exit status 1 (nothing is switched off instead)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "rollout.py"


@pytest.fixture(scope="module")
def rollout():
    spec = importlib.util.spec_from_file_location("bench_rollout", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its annotations through it
    spec.loader.exec_module(module)
    return module


def test_tiny_run_records_every_section_that_runs_here(rollout, tmp_path):
    out = tmp_path / "w2.json"
    variants = ["pdl=0", "deterministic=1,down@64.split_k=2"]
    report = rollout.main([str(out), "--tiny", "--batches", "2", "--baseline-tokens", "4", "--skip", "cb",
                           "--variants", *variants, "--fp32-check"])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["problems"] == [] and report.exit_status() == 0, saved.get("errors")
    assert saved["workload"] == "W2" and "--tiny" in saved["command"] and "torch" in saved["versions"]
    run = saved["engine"]["B2"]
    assert run["tokens"] == 2 * 8 and run["tok_s"] > 0 and len(run["runs_s"]) == 3  # no EOS: full length
    assert len(run["prefill_runs_s"]) == 3 and run["stats"]["prefill_s"] in run["prefill_runs_s"]
    assert len(run["full_gc_runs"]) == 3 and all(n >= 0 for n in run["full_gc_runs"])
    assert run["stats"]["decode_steps"] == 7 and saved["engine_compile_failed"] == []
    assert saved["engine_config"]["layers"] == 2 and "fused_decode" in saved["engine_config"]
    assert set(saved["engine_variants"]) == set(variants)
    assert all(v["B2"]["tokens"] == 16 for v in saved["engine_variants"].values())
    assert saved["engine_unfused"]["B2"]["tokens"] == 16
    assert saved["release_then_reuse"]["captures"] == 0
    assert saved["prefill_profile"]["top"], "the profile of a prefill lists its kernels (CPU: operators)"
    assert saved["greedy_bf16"]["rows"] == 8
    assert saved["greedy_fp32"]["identical_rows"] == 8  # fp32: the engine's math is generate's
    assert saved["greedy_fp32_deterministic"]["identical_rows"] == 8  # and the deterministic kernels' too
    assert saved["hf"]["B2"]["tokens"] == 2 * 4
    assert saved["skipped"]["cb"] == "--skip" and "cb" not in saved
    if not torch.cuda.is_available():
        assert saved["skipped"]["roofline"] == saved["skipped"]["profile"] == "needs CUDA"


def test_the_previous_scripts_command_lines_parse(rollout):
    skipped = ["hf", "cb", "greedy", "profile", "ungrouped", "unfused", "reuse", "prefill"]
    args = rollout.parse_args(["o.json", "--batches", "64", "256", "--skip", *skipped, "--variants", "deterministic=1"])
    assert args.batches == [64, 256] and args.variants == ["deterministic=1"]
    assert (args.prompt_tokens, args.new_tokens, args.baseline_tokens) == (256, 256, 64)


def test_a_variant_names_engine_flags_and_kernel_settings(rollout):
    from slimrl.rollout.engine import RolloutEngine
    from slimrl.rollout.fused_ops import PREFILL
    from slimrl.testing import tiny_model

    engine = RolloutEngine(tiny_model("qwen2").eval())
    flags, pdl = rollout.parse_variant("deterministic=1,down@64.split_k=2,o@8.gemm=0,qkv.block_k=32,pdl=0", engine)
    choices = flags.pop("kernel_choices")
    assert flags == {"deterministic": True} and pdl == 0
    assert choices["down"][64].split_k == 2 and choices["down"][16].split_k == 1  # one row bucket
    assert choices["o"][16].gemm is False  # 8 rows fall in the 16-row bucket; the field keeps its type
    assert [choices["qkv"][b].block_k for b in (16, 64, 256)] == [32] * 3  # every decode bucket ...
    assert choices["qkv"][PREFILL].block_k != 32  # ... not the prefill's
    with pytest.raises(AttributeError):
        rollout.parse_variant("down.no_such_field=1", engine)


def test_a_failed_check_and_a_raising_section_are_problems(rollout, tmp_path, monkeypatch):
    def differs(model, prompts, completions, new_tokens):
        return {"identical_rows": 7, "rows": 8, "matching_prefix": [64] * 7 + [3]}

    def broken(*args, **kwargs):
        raise RuntimeError("injected profiler failure")

    monkeypatch.setattr(rollout.common, "greedy_agreement", differs)
    monkeypatch.setattr(rollout.common, "kernel_profile", broken)
    out = tmp_path / "w2.json"
    report = rollout.main([str(out), "--tiny", "--batches", "2", "--fp32-check", "--skip", "engine", "variants",
                           "reuse", "unfused", "greedy", "hf", "cb"])  # fmt: skip
    saved = json.loads(out.read_text())
    assert report.exit_status() == 1
    assert any(p.startswith("prefill raised RuntimeError: injected") for p in saved["problems"]), saved["problems"]
    assert any(p.startswith("greedy_fp32: differs from generate") for p in saved["problems"]), saved["problems"]
    assert "injected profiler failure" in saved["errors"]["prefill"]
    assert saved["greedy_fp32"]["identical_rows"] == 7  # the section ran after the one that raised


# -- issue 33: W2 on Gemma-3-1B's and Qwen3-MoE's shapes (bench/models.py) ------------------------------------------

LEAN = ["--tiny", "--batches", "2", "--baseline-tokens", "4", "--skip", "variants", "reuse", "prefill", "unfused",
        "greedy", "cb"]  # fmt: skip


@pytest.mark.parametrize("name", ["gemma3-1b", "qwen3-moe"])
def test_a_tiny_run_of_each_other_model_times_the_engine_beside_trls_generate(rollout, tmp_path, name):
    out = tmp_path / "w2.json"
    report = rollout.main([str(out), "--model", name, *LEAN])
    saved = json.loads(out.read_text())
    assert saved["problems"] == [] and report.exit_status() == 0, saved.get("errors")
    model, config = saved["model"], saved["model"]["config"]
    assert model["name"] == name and model["parameters"] > 0 and model["lora_parameters"] > 0
    assert model["dtype"] == "bfloat16" and "--model" in saved["command"]
    assert saved["engine"]["B2"]["tokens"] == 2 * 8 and saved["hf"]["B2"]["tokens"] == 2 * 4  # no EOS: full length
    engine, hf = saved["engine"]["B2"]["tok_s"], saved["hf"]["B2"]["tok_s"]
    assert saved["speedup_vs_hf"] == {"B2": round(engine / hf, 1)}
    if name == "gemma3-1b":  # the features of the real one: a window shorter than the prompts, both layer kinds
        assert model["architecture"] == "Gemma3ForCausalLM" and config["sliding_window"] < saved["prompt_tokens"]
        assert config["layer_types"] == {"full_attention": 1, "sliding_attention": 1}
        assert saved["engine_config"]["fused_kernel_groups"] == []
    else:  # peft's all-linear reaches the router and the experts' 3-D weights as well as the attention
        assert model["architecture"] == "Qwen3MoeForCausalLM" and config["num_experts"] > config["num_experts_per_tok"]
        targets = model["lora_targets"]
        assert {"mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj"} <= set(
            targets)  # fmt: skip
        assert targets["mlp.experts.gate_up_proj"]["layers"] == config["num_hidden_layers"]
        assert saved["engine_config"]["fused_kernel_groups"] == ["o", "qkv"]


def full_size(name: str):
    """The full-size model on the meta device (shapes, no memory), for what its docstring claims."""
    sys.path.insert(0, str(SCRIPT.parent))
    import models

    return models, models.build(name, device="meta", lora_b_std=0.01)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_the_full_size_gemma_has_gemma_3_1bs_layer_pattern_and_size():
    models, model = full_size("gemma3-1b")
    config = model.config
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17, 23]  # 5 local : 1
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    described = models.describe("gemma3-1b", model)
    assert abs(described["parameters"] / 1e9 - 1.0) < 0.01  # Gemma-3-1B: 1.0B parameters, embeddings tied


def test_the_full_size_moe_fits_an_h100_with_24_of_its_48_layers():
    models, model = full_size("qwen3-moe")
    params = dict(model.named_parameters())
    weights = nbytes(p for n, p in params.items() if "lora_" not in n)
    lora = nbytes(p for n, p in params.items() if "lora_" in n)
    layers = model.config.num_hidden_layers
    embeddings = nbytes(p for n, p in params.items() if "embed_tokens" in n or "lm_head" in n)
    per_layer = (weights + lora - embeddings) / layers
    assert models.describe("qwen3-moe", model)["layers_of_real_model"] == 2 * layers == 48
    real = (weights - embeddings) / layers * 48 + embeddings
    assert abs(real / 2 / 1e9 - 30.5) < 0.3  # bf16 bytes / 2: Qwen3-30B-A3B's 30.5B parameters at 48 layers
    assert (weights + lora) / 2**30 < 40  # 24 layers: room for generate's working set and a batch-256 KV cache
    assert (embeddings + 48 * per_layer) / 2**30 > 70  # 48 layers would leave none on an 80 GB GPU


def test_the_roofline_counts_each_layers_window_and_the_routed_experts(rollout):
    import argparse

    from slimrl.rollout.engine import RolloutEngine

    args = argparse.Namespace(prompt_tokens=64, new_tokens=8)
    context = 64 + 8 / 2
    for name in ("gemma3-1b", "qwen3-moe"):
        model = rollout.common.model_for(name, tiny=True, device="cpu").eval()
        bench = rollout.Bench(args, rollout.Report("unused.json"), model, RolloutEngine(model))
        c = model.config
        kv_token = 2 * c.num_key_value_heads * c.head_dim * 2  # bf16 K and V of one token in one layer
        weights = rollout.common.weight_bytes(model)
        if name == "gemma3-1b":  # a sliding layer reads its window of the cache, the global layer all of it
            expected = {b: weights + b * kv_token * (c.sliding_window + context) for b in (1, 8)}
        else:  # each token picks top_k of E: expert e unread with probability (1 - k/E)^batch
            experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
            unread = {b: (1 - c.num_experts_per_tok / c.num_experts) ** b for b in (1, 8)}
            expected = {b: weights - experts * unread[b] + b * kv_token * 2 * context for b in (1, 8)}
        assert {b: rollout.step_bytes(bench, b) for b in (1, 8)} == pytest.approx(expected), name


def test_a_variant_setting_a_kernel_the_model_does_not_run_is_skipped_with_the_reason(rollout, tmp_path):
    import argparse

    from slimrl.rollout.engine import RolloutEngine

    model = rollout.common.model_for("gemma3-1b", tiny=True, device="cpu").eval()
    args = argparse.Namespace(variants=["down@64.split_k=2"], batches=[2])
    bench = rollout.Bench(args, rollout.Report(tmp_path / "w2.json", skipped={}), model, RolloutEngine(model))
    rollout.section_variants(bench)
    assert bench.report["engine_variants"] == {}
    assert "runs no fused ['down'] kernel" in bench.report["skipped"]["variant down@64.split_k=2"]


def test_a_repeated_variant_keeps_every_runs_figures(rollout, monkeypatch, tmp_path):
    """--variants A B A (the A/B/A order that shows the spread between runs): the second A is reported as "A #2" beside
    the first, not over it."""
    import argparse

    timed = []

    def fake_time_fresh(bench, into, label, **flags):
        timed.append((label, flags))
        into["B8"] = {"decode_step_ms": float(len(timed))}

    monkeypatch.setattr(rollout, "time_fresh", fake_time_fresh)
    monkeypatch.setattr(rollout, "kernel_groups", lambda engine: {"qkv", "o", "gate_up", "down"})
    args = argparse.Namespace(variants=["deterministic=1", "pdl=0", "deterministic=1", "deterministic=1"])
    report = rollout.common.Report(str(tmp_path / "w2.json"), skipped={})
    bench = rollout.Bench(args, report, model=None, engine=None)
    rollout.section_variants(bench)
    runs = bench.report["engine_variants"]
    assert list(runs) == ["deterministic=1", "pdl=0", "deterministic=1 #2", "deterministic=1 #3"]
    assert [runs[k]["B8"]["decode_step_ms"] for k in runs] == [1.0, 2.0, 3.0, 4.0]
    assert [flags for _, flags in timed] == [{"deterministic": True}, {}, {"deterministic": True},
                                             {"deterministic": True}]  # fmt: skip
    assert report["problems"] == [] and json.loads((tmp_path / "w2.json").read_text())["engine_variants"] == runs
