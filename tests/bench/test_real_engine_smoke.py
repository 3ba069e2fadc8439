"""bench/real_engine.py on the CPU with the tiny model: both dtypes measured (greedy agreement, log-prob deltas
against the training forward), the reference forward's batching is exact, and a dtype that raises is recorded."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "real_engine.py"


@pytest.fixture(scope="module")
def real_engine():
    spec = importlib.util.spec_from_file_location("bench_real_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_measures_greedy_agreement_and_logprob_deltas_in_both_dtypes(real_engine, tmp_path, capsys):
    out = tmp_path / "real_engine.json"
    real_engine.main([str(out), "--tiny", "--prompts", "6", "--max-new-tokens", "12"])
    saved = json.loads(out.read_text())
    # the bf16 requirement is a finding (the tiny random model, 72 tokens: either side can come out ahead), not a
    # failure of the script; nothing may have raised
    assert not [p for p in saved["problems"] if "raised" in p], saved["problems"]
    assert set(saved["versions"]) >= {"torch", "transformers", "peft", "trl", "triton"}
    for name in ("bf16", "fp32"):
        part = saved["dtypes"][name]
        assert part["status"] == "ok", part.get("error")
        assert len(set(part["prompt_lengths"])) == 6  # 0 to 5 sentences of system message: six lengths
        greedy = part["greedy"]
        assert greedy["rows"] == len(greedy["first_divergence"]) == 6
        # every token the same exactly when every row is (a row differs in a token or in its length)
        assert (greedy["identical_token_share"] == 1.0) == (greedy["identical_rows"] == 6)
        assert part["adapter"]["greedy_rows_changed_by_adapter"] > 0  # the randomised lora_B is live
        for side in ("engine", "generate"):
            stats = part["logprobs"][side]
            assert stats["tokens"] > 0 and math.isfinite(stats["mean_abs"])
            assert stats["mean_abs"] <= stats["p99_abs"] <= stats["max_abs"] or stats["tokens"] < 100
        logprobs = part["logprobs"]  # the requirement: the engine no further from the training forward than generate
        engine, generate = logprobs["engine"]["mean_abs"], logprobs["generate"]["mean_abs"]
        assert logprobs["requirement_met"] is (engine <= generate or max(engine, generate) <= logprobs["noise_floor"])
    assert saved["dtypes"]["fp32"]["logprobs"]["requirement_met"] is True  # both at fp32 rounding: the noise floor
    assert saved["dtypes"]["fp32"]["greedy"]["identical_rows"] == 6  # fp32 on the CPU: the same argmax everywhere
    assert saved["dtypes"]["fp32"]["logprobs"]["engine"]["max_abs"] < 1e-4
    fp32 = saved["dtypes"]["fp32"]  # an engine that ignored the adapter would be off by the adapter's own shift
    assert fp32["adapter"]["logprob_shift"]["mean_abs"] > 100 * fp32["logprobs"]["engine"]["mean_abs"]
    assert saved["dtypes"]["bf16"]["engine"]["cuda_graphs"] is False  # CPU: eager engine
    assert "| bf16 |" in capsys.readouterr().out


def test_training_forward_batched_as_trl_matches_one_row_at_a_time(real_engine):
    from slimrl.testing import tiny_model

    model = tiny_model("llama").eval()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    completions = [[20, 21, 3], [22], [23, 24, 25, 26]]
    batched = real_engine.training_logprobs(model, prompts, completions, pad_id=0, batch=3)
    for prompt, completion, row in zip(prompts, completions, batched, strict=True):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row), alone, atol=1e-5, rtol=0)


def test_greedy_agreement_and_deltas_count_as_documented(real_engine):
    result = real_engine.greedy_agreement([[1, 2, 3], [4, 5], [7]], [[1, 2, 3], [4, 6, 9], [7, 8]])
    assert result["identical_rows"] == 1 and result["first_divergence"] == [None, 1, 1]
    assert result["identical_token_share"] == pytest.approx((3 + 1 + 1) / (3 + 3 + 2))
    stats = real_engine.delta_stats([[0.0, -1.0], [-2.0]], [[0.5, -1.0], [-1.0]])
    assert stats["tokens"] == 3 and stats["max_abs"] == 1.0 and stats["mean_abs"] == pytest.approx(0.5)
    assert real_engine.cut_at_stop([4, 3, 9], {3}) == [4, 3] and real_engine.cut_at_stop([4, 9], {3}) == [4, 9]


def test_a_dtype_that_raises_is_recorded_and_the_exit_status_is_1(real_engine, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(real_engine, "load_model", broken)
    report = real_engine.main([str(tmp_path / "r.json"), "--tiny", "--dtypes", "bf16"])
    assert report["dtypes"]["bf16"]["status"] == "error" and "injected failure" in report["dtypes"]["bf16"]["error"]
    assert report.exit_status() == 1 and report["problems"][0].startswith("bf16 raised")
