"""bench/preference_memory.py (W4 DPO, W5 SFT) on a tiny model on the CPU: TRL's and slimrl's sides both run one
training step on the same data, their losses agree (the script's own check), the side without liger-kernel is
recorded as such, and the report carries the command and the versions."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "preference_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_preference_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("algorithm", ["dpo", "sft"])
def test_tiny_run_measures_trl_and_slimrl_with_equal_losses(bench, tmp_path, algorithm):
    out = tmp_path / f"{algorithm}.json"
    status = bench.main([str(out), "--algorithm", algorithm, "--tiny", "--lengths", "24"])
    report = json.loads(out.read_text())
    assert status == 0 and report["problems"] == []
    assert report["workload"] == ("W4" if algorithm == "dpo" else "W5") and "--tiny" in report["command"]
    assert set(report["versions"]) >= {"torch", "transformers", "trl", "peft"}
    trl_side, slimrl_side = report["results"]["trl_L24"], report["results"]["slimrl_L24"]
    assert math.isclose(slimrl_side["loss"], trl_side["loss"], rel_tol=1e-4)
    assert math.isclose(slimrl_side["grad_norm"], trl_side["grad_norm"], rel_tol=1e-3)
    assert slimrl_side["tokens"] == trl_side["tokens"] > 0
    liger = report["results"]["liger_L24"]
    assert isinstance(liger, dict) or liger == "liger-kernel is not installed"
