"""bench/grpo_step.py (W3) on a tiny model on the CPU: both trainers run, each step is split into phases that add up
to the step, a side that raises is recorded while the other still runs, engine rollouts are recorded as such, and the
offline tokenizer decodes every id of W1's vocabulary; --algorithm rloo (TRL's RLOO beside slimrl's) and ppo (slimrl's
PPO beside slimrl's GRPO) time their own trainers the same way."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "grpo_step.py"


@pytest.fixture(scope="module")
def grpo_step():
    spec = importlib.util.spec_from_file_location("bench_grpo_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_times_both_trainers_step_by_step(grpo_step, tmp_path):
    """With --shared-prompt: slimrl's GRPO with shared_prompt_forward=True runs as a third side, after slimrl's."""
    out = tmp_path / "w3.json"
    returned = grpo_step.main([str(out), "--tiny", "--steps", "2", "--trl-steps", "2", "--shared-prompt"])
    report = json.loads(out.read_text())
    assert report["problems"] == [] and returned["problems"] == []
    assert report["workload"] == "W3" and "--tiny" in report["command"]
    assert set(report["versions"]) >= {"torch", "transformers", "trl", "peft"}
    assert report["settings"]["prompt_tokens_min_max"] == [128, 128]  # every prompt padded to the asked length
    assert list(report["sides"]) == ["slimrl", "slimrl_shared_prompt", "trl"] and report["settings"]["shared_prompt"]
    for kind in ("slimrl", "slimrl_shared_prompt", "trl"):
        side = report["sides"][kind]
        assert side["status"] == "ok", side.get("error")
        assert side["steps_requested"] == side["steps_run"] == len(side["steps"]) == 2
        assert side["generation_backend"] == "transformers"  # no CUDA: slimrl's engine is not chosen
        for step in side["steps"]:
            phases = [step["generation_s"], step["reward_s"], step["training_s"]]
            assert all(seconds > 0 for seconds in phases), (kind, step)
            assert sum(phases) <= step["step_s"] + 1e-3, (kind, step)  # each value is rounded to 1e-4
            assert math.isfinite(step["loss"]) and step["completion_mean_length"] > 0
        assert side["mean_after_first"]["step_s"] > 0 and side["mean_all"]["step_s"] > 0
    first = [report["sides"][kind]["steps"][0]["loss"] for kind in ("slimrl", "trl")]
    assert first[0] == pytest.approx(first[1], abs=1e-5), first  # same model, data and seed: the same first loss
    assert set(report["speedup"]["mean_after_first"]) == {"step_s", "generation_s", "reward_s", "training_s"}
    assert report["sides"]["slimrl_shared_prompt"]["shared_prompt_fallbacks"] == []  # the packed forward ran
    assert "shared_prompt_fallbacks" not in report["sides"]["slimrl"]
    gain = report["shared_prompt"]  # slimrl's seconds over the shared side's, both sides' peaks and first losses
    assert gain["speedup_is"] == "slimrl seconds / slimrl_shared_prompt seconds" and gain["fallbacks"] == []
    assert gain["mean_after_first"]["training_s"] > 0 and set(gain["peak_GiB"]) == {"slimrl", "slimrl_shared_prompt"}
    losses = gain["first_loss"]  # the same run but for the training forward: the same first loss
    assert losses["slimrl"] == pytest.approx(losses["slimrl_shared_prompt"], abs=1e-5) and losses["slimrl"] != 0
    with pytest.raises(SystemExit):
        grpo_step.parse_args(["x.json", "--algorithm", "rloo", "--shared-prompt"])


def assert_timed_steps(side: dict, steps: int) -> None:
    """Every step ran, each phase took time, the phases fit in the step, and the loss and step time are finite."""
    assert side["status"] == "ok", side.get("error")
    assert side["steps_requested"] == side["steps_run"] == len(side["steps"]) == steps
    for step in side["steps"]:
        phases = [step["generation_s"], step["reward_s"], step["training_s"]]
        assert all(seconds > 0 for seconds in phases), step
        assert sum(phases) <= step["step_s"] + 1e-3, step  # each value is rounded to 1e-4
        assert math.isfinite(step["step_s"]) and math.isfinite(step["loss"]), step
    assert side["mean_all"]["step_s"] > 0 and math.isfinite(side["mean_all"]["loss"])


def test_rloo_times_trls_and_slimrls_rloo_trainers(grpo_step, tmp_path):
    out = tmp_path / "w3_rloo.json"
    report = grpo_step.main([str(out), "--tiny", "--algorithm", "rloo", "--steps", "2", "--trl-steps", "2"])
    saved = json.loads(out.read_text())
    assert report.exit_status() == 0 and saved["problems"] == [], saved["problems"]
    assert saved["algorithm"] == "rloo" and list(saved["sides"]) == ["slimrl_rloo", "trl_rloo"]
    assert saved["settings"]["num_generations"] == 8 and saved["settings"]["beta"] == 0.0
    for kind, trainer in (("slimrl_rloo", "slimrl.trainers.rloo.trainer.RLOOTrainer"), ("trl_rloo", "RLOOTrainer")):
        side = saved["sides"][kind]
        assert side["trainer"].endswith(trainer) and side["trainer"].split(".")[0] == kind.split("_")[0]
        assert_timed_steps(side, 2)
    first = [saved["sides"][kind]["steps"][0]["loss"] for kind in ("slimrl_rloo", "trl_rloo")]
    assert first[0] == pytest.approx(first[1], abs=1e-5)  # same model, data, seed and settings: same first loss
    assert saved["speedup_is"] == "trl_rloo seconds / slimrl_rloo seconds"
    assert set(saved["speedup"]["mean_after_first"]) == {"step_s", "generation_s", "reward_s", "training_s"}


def test_ppo_times_slimrls_ppo_beside_its_grpo_at_the_same_batch(grpo_step, tmp_path):
    out = tmp_path / "w3_ppo.json"
    report = grpo_step.main([str(out), "--tiny", "--algorithm", "ppo", "--steps", "2"])
    saved = json.loads(out.read_text())
    assert report.exit_status() == 0 and saved["problems"] == [], saved["problems"]
    assert list(saved["sides"]) == ["slimrl_ppo", "slimrl_grpo"]
    assert saved["settings"]["ppo"]["prompts_per_step"] * saved["settings"]["ppo"]["completions_per_prompt"] == 8
    ppo, grpo = saved["sides"]["slimrl_ppo"], saved["sides"]["slimrl_grpo"]
    assert ppo["trainer"] == "slimrl.trainers.ppo.trainer.PPOTrainer"
    assert grpo["trainer"] == "slimrl.trainers.grpo.trainer.GRPOTrainer"
    assert_timed_steps(ppo, 2)
    assert_timed_steps(grpo, 2)
    for step in ppo["steps"]:  # the value/reference scoring pass is timed on its own, inside the training phase
        assert 0 < step["scoring_pass_s"] < step["training_s"], step
        assert math.isfinite(step["value_loss"]) and math.isfinite(step["policy_loss"])
    assert ppo["mean_all"]["scoring_pass_s"] > 0 and "scoring_pass_s" not in grpo["mean_all"]
    assert saved["speedup_is"] == "slimrl_grpo seconds / slimrl_ppo seconds"
    assert saved["speedup"]["mean_all"]["step_s"] > 0 and len(saved["speedup"]["per_step"]["step_s"]) == 2


def test_skip_names_a_side_of_the_chosen_algorithm(grpo_step):
    assert grpo_step.parse_args(["x.json", "--algorithm", "ppo", "--skip", "slimrl_grpo"]).skip == ["slimrl_grpo"]
    with pytest.raises(SystemExit):
        grpo_step.parse_args(["x.json", "--algorithm", "rloo", "--skip", "trl"])  # grpo's TRL side, not RLOO's


def test_a_side_that_raises_is_recorded_and_the_other_still_runs(grpo_step, tmp_path, monkeypatch):
    build = grpo_step.build_trainer

    def build_or_fail(kind, *args, **kwargs):
        if kind == "slimrl":
            raise RuntimeError("injected failure")
        return build(kind, *args, **kwargs)

    monkeypatch.setattr(grpo_step, "build_trainer", build_or_fail)
    report = grpo_step.main([str(tmp_path / "w3.json"), "--tiny", "--steps", "1", "--trl-steps", "1"])
    assert report["sides"]["slimrl"]["status"] == "error"
    assert "injected failure" in report["sides"]["slimrl"]["error"]
    assert report["sides"]["trl"]["status"] == "ok" and report["sides"]["trl"]["steps_run"] == 1
    assert report["problems"] and "slimrl raised" in report["problems"][0]


def test_offline_tokenizer_decodes_every_id_of_w1s_vocabulary(grpo_step):
    from slimrl.testing import tiny_tokenizer

    tokenizer = grpo_step.offline_tokenizer(grpo_step.W1_VOCAB)
    assert len(tokenizer) == grpo_step.W1_VOCAB
    text = "<|im_start|>user\nWhat is 12 - 5?<|im_end|>\n"
    assert tokenizer(text)["input_ids"] == tiny_tokenizer()(text)["input_ids"]  # prompts: the testing ids
    assert all(tokenizer.decode([i]) for i in (260, 9000, 100_000, grpo_step.W1_VOCAB - 1))  # the rest: text


def test_slimrl_engine_rollouts_are_recorded_as_such(grpo_step, tmp_path):
    # on the GPU "auto" picks the engine; here it is asked for, so the bookkeeping that proves it ran is exercised
    report = grpo_step.main([str(tmp_path / "w3.json"), "--tiny", "--steps", "1", "--skip", "trl",
                             "--slimrl-backend", "engine"])  # fmt: skip
    side = report["sides"]["slimrl"]
    assert side["status"] == "ok", side.get("error")
    assert side["generation_backend"] == "engine" and side["engine_used"] and side["engine"] is not None
    assert side["steps"][0]["engine_stats"]["decode_steps"] > 0
    assert report["sides"]["trl"]["status"] == "skipped" and report["speedup"] is None


def test_real_mode_runs_the_demos_task_on_both_trainers_and_reports_stalls_and_speedups(grpo_step, tmp_path):
    # --real --tiny: the real-model code path (FastLanguageModel's LoRA, the demo's data and rewards) on the tiny Llama
    out = tmp_path / "w3_real.json"
    report = grpo_step.main([str(out), "--real", "--tiny", "--steps", "3", "--trl-steps", "3"])
    saved = json.loads(out.read_text())
    assert report.exit_status() == 0 and saved["problems"] == [], saved["problems"]
    assert saved["real"] is True and saved["settings"]["completion_length"] == 16
    assert saved["settings"]["rewards"] == ["exact_answer_reward", "format_reward"]
    for kind in ("slimrl", "trl"):
        side = saved["sides"][kind]
        assert side["status"] == "ok" and side["steps_run"] == 3, side.get("error")
        later = [step["training_s"] for step in side["steps"][1:]]
        assert side["training_median_after_first"] == pytest.approx(sorted(later)[0] / 2 + sorted(later)[1] / 2,
                                                                    abs=1e-3)  # fmt: skip
        assert side["stall_ratio"] == pytest.approx(max(later) / side["training_median_after_first"], abs=0.02)
        assert side["step_mean"] > 0 and side["prompt_tokens_min_max"][0] > 10
    first = [saved["sides"][kind]["steps"][0]["loss"] for kind in ("slimrl", "trl")]
    assert first[0] == pytest.approx(first[1], abs=1e-5)  # same model, data, seed and settings: same first loss
    speedup = saved["speedup"]
    assert len(speedup["per_step"]["step_s"]) == len(speedup["per_step"]["training_s"]) == 3
    assert speedup["training_median_after_first"] > 0 and speedup["mean_all"]["step_s"] > 0


def test_real_mode_defaults_are_30_steps_each_and_256_tokens(grpo_step):
    args = grpo_step.parse_args(["x.json", "--real"])
    assert (args.steps, args.trl_steps, args.completion_length, args.prompt_tokens) == (30, 30, 256, None)
    w1 = grpo_step.parse_args(["x.json"])
    assert (w1.steps, w1.trl_steps, w1.completion_length, w1.prompt_tokens) == (10, 3, 1024, 256)
    with pytest.raises(SystemExit):
        grpo_step.parse_args(["x.json", "--real", "--prompt-tokens", "64"])


def test_a_failure_outside_the_sides_is_saved_with_its_traceback(grpo_step, tmp_path, monkeypatch):
    def broken(args):
        raise RuntimeError("no data")

    monkeypatch.setattr(grpo_step, "build_data", broken)
    out = tmp_path / "w3.json"
    report = grpo_step.main([str(out), "--tiny", "--steps", "1", "--trl-steps", "1"])
    saved = json.loads(out.read_text())
    assert report.exit_status() == 1 and "RuntimeError: no data" in saved["error"]
    assert saved["problems"] == ["raised RuntimeError: no data"]
