"""bench/gguf_roundtrip.py on the CPU with the tiny model: the demo trains a step, the adapter model and its q8_0 GGUF
(reloaded by transformers) are scored on the same held-out problems, and the report carries both accuracies, their
difference, the file's size, the versions (gguf's included) and the command."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gguf_roundtrip.py"


def test_tiny_run_scores_the_trained_model_and_its_gguf_export(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_gguf_roundtrip", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gguf.json"
    threads = torch.get_num_threads()
    try:
        report = module.main([str(out), "--tiny", "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)  # the demo takes every core for itself
    saved = json.loads(out.read_text())
    assert saved["problems"] == [] and report.exit_status() == 0
    assert "--tiny" in saved["command"] and set(saved["versions"]) >= {"torch", "transformers", "peft", "gguf"}
    assert saved["demo_settings"]["model"] == "tiny" and saved["demo_settings"]["eval_size"] == 4
    for key in ("accuracy_trained", "accuracy_gguf"):
        assert {saved[key]["accuracy"] * 4, saved[key]["in_format"] * 4} <= {0.0, 1.0, 2.0, 3.0, 4.0}  # k of 4
    difference = saved["accuracy_gguf"]["accuracy"] - saved["accuracy_trained"]["accuracy"]
    assert saved["accuracy_difference"] == round(difference, 4)
    assert saved["file"] == "model.Q8_0.gguf" and saved["file_bytes"] > 0 and saved["reload_dtype"] == "float32"
