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
    assert run["stats"]["decode_steps"] == 7 and saved["engine_compile_failed"] == []
    assert saved["engine_config"]["layers"] == 2 and "fused_decode" in saved["engine_config"]
    assert set(saved["engine_variants"]) == set(variants)
    assert all(v["B2"]["tokens"] == 16 for v in saved["engine_variants"].values())
    assert saved["engine_unfused"]["B2"]["tokens"] == 16
    assert saved["release_then_reuse"]["captures"] == 0
    assert saved["prefill_profile"]["top"], "the profile of a prefill lists its kernels (CPU: operators)"
    assert saved["greedy_bf16"]["rows"] == 8
    assert saved["greedy_fp32"]["identical_rows"] == 8  # fp32: the engine's math is generate's
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
    assert any(p.startswith("fp32 greedy differs from generate") for p in saved["problems"]), saved["problems"]
    assert "injected profiler failure" in saved["errors"]["prefill"]
    assert saved["greedy_fp32"]["identical_rows"] == 7  # the section ran after the one that raised
