"""bench/rollout_device_check.py on the CPU with the tiny model: the engine process on the CPU holds the trainer's
model for the 4-bit base (sent packed) and the full-precision one, and the report says so."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.distributed.preloaded_engines import use_preloaded_engine_processes

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "rollout_device_check.py"


def test_tiny_run_finds_the_engine_process_holding_the_trainers_model(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    use_preloaded_engine_processes(monkeypatch)  # its two engine processes forked from one preloaded server
    spec = importlib.util.spec_from_file_location("bench_rollout_device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "check.json"
    report = module.main([str(out), "--tiny", "--generation-device", "cpu", "--max-new-tokens", "8",
                          "--logprob-tolerance", "1e-4"])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["problems"] == [] and report.exit_status() == 0
    assert set(saved["versions"]) >= {"torch", "transformers", "peft"}
    quantised, full = saved["bases"]["4bit"], saved["bases"]["compute"]
    for result in (quantised, full):
        assert result["identical_completions"] == result["completions"] == 8
        assert result["engine_state_bytes"] == result["trainer_state_bytes"] and result["transport"] == "gloo"
    assert quantised["engine_quantized"] and not full["engine_quantized"]
    assert quantised["bytes_sent_once"] < full["bytes_sent_once"]
