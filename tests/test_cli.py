"""The `slimrl` command: `slimrl demo` end to end on a tiny model, --version, --help and bad settings; a non-finite
step stops the demo (recorded, evaluated, saved, exit 1) or is skipped with --on-nonfinite skip."""

import json

import pytest
import torch

from slimrl.cli import build_parser, main
from slimrl.cli.demo_report import accuracy_line

TINY_DEMO = ["demo", "--model", "tiny", "--steps", "2", "--eval-size", "4", "--num-generations", "4",
             "--max-completion-length", "8", "--device", "cpu"]  # fmt: skip


def test_demo_on_a_tiny_model_writes_adapter_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main([*TINY_DEMO, "--output-dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy before" in printed and "held-out accuracy after" in printed
    assert "step   1/2  reward" in printed and "step   2/2  reward" in printed
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((out / "metrics.json").read_text())
    assert [entry["step"] for entry in metrics["history"]] == [1, 2]
    for entry in metrics["history"]:
        assert {"reward", "rewards/exact_answer_reward/mean", "rewards/format_reward/mean", "loss"} <= entry.keys()
    assert metrics["settings"]["steps"] == 2
    for when, label in (("before", "before:"), ("after", "after: ")):  # what was printed is what was saved
        scores = metrics[f"accuracy_{when}"]
        assert {scores["accuracy"] * 4, scores["in_format"] * 4} <= {0.0, 1.0, 2.0, 3.0, 4.0}  # k of 4 problems
        assert accuracy_line(label, scores) in printed, accuracy_line(label, scores)
    for entry in metrics["history"]:  # the step timer's split of each step
        parts = [entry["generation_s"], entry["reward_s"], entry["training_s"]]
        assert parts[0] > 0 and parts[2] > 0 and parts[1] >= 0, entry
    assert metrics["status"] == "finished" and metrics["raised_nonfinite_error"] is False
    assert metrics["nonfinite_error"] is None and metrics["nonfinite_skipped_steps"] == []
    assert metrics["rollout_engine_used"] is False  # CPU: "auto" generates with transformers
    assert metrics["layer_graphs"] is None  # no offloaded checkpoints on a CPU run without them: no layer graphs
    assert str(out / "metrics.json") in printed and str(out / "reward.png") in printed


def test_generation_backend_engine_makes_the_demo_generate_with_slimrls_engine(tmp_path):
    out = tmp_path / "demo"
    assert main([*TINY_DEMO, "--steps", "1", "--output-dir", str(out), "--generation-backend", "engine"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rollout_engine_used"] is True and metrics["settings"]["generation_backend"] == "engine"


def test_the_demo_trains_with_its_engine_on_a_rollout_device_one_step_ahead(tmp_path, capsys, monkeypatch):
    from tests.distributed.preloaded_engines import use_preloaded_engine_processes

    use_preloaded_engine_processes(monkeypatch)  # the engine process forked from a preloaded server
    out = tmp_path / "demo"
    flags = ["--steps", "3", "--output-dir", str(out), "--generation-device", "cpu", "--async-generation"]
    assert main([*TINY_DEMO, *flags]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["rollout_engine_used"] is True
    assert metrics["settings"]["generation_device"] == "cpu" and metrics["settings"]["async_generation"] is True
    assert [entry["step"] for entry in metrics["history"]] == [1, 2, 3]
    assert [entry["rollout/staleness"] for entry in metrics["history"]] == [0, 1, 1]
    # the adapter goes to the engine as each step's rollout is sent ahead; the last step sends none
    assert [entry.get("rollout/sync_bytes", 0) > 0 for entry in metrics["history"]] == [True, True, False]


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_each_online_algorithm_runs_the_demo_with_the_same_metrics(algorithm, tmp_path, capsys):
    out = tmp_path / algorithm
    assert main([*TINY_DEMO, "--algorithm", algorithm, "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"slimrl demo: {algorithm.upper()} on tiny" in printed and "step   2/2  reward" in printed
    assert "nans" not in printed and "len  nan" not in printed  # every algorithm reports length and step time
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["settings"]["algorithm"] == algorithm and metrics["status"] == "finished"
    assert [entry["step"] for entry in metrics["history"]] == [1, 2]
    for entry in metrics["history"]:  # PPO's objective/scores and rewards/<f> under the demo's names
        assert {"reward", "rewards/exact_answer_reward/mean", "rewards/format_reward/mean", "loss"} <= entry.keys()
        assert entry["training_s"] > 0 and entry["reward_s"] >= 0
    assert metrics["history"][0]["generation_s"] > 0  # PPO generates at the first step of each rollout
    if algorithm == "ppo":  # one rollout of 4 x 2 problems, trained on for two steps
        assert "objective/kl" in metrics["history"][0] and metrics["history"][1]["generation_s"] == 0.0
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and "slimrl 0.1.0" in capsys.readouterr().out
    assert "demo" in build_parser().format_help()
    assert main([]) == 2 and "usage: slimrl" in capsys.readouterr().out  # no command: the help, not a traceback


@pytest.mark.parametrize(
    "flags,message",
    [(["--num-generations", "1"], "--num-generations must be at least 2"), (["--steps", "0"], "--steps must be"),
     (["--eval-size", "1000"], "use at most"), (["--learning-rate", "0"], "--learning-rate must be positive"),
     (["--async-generation"], "--async-generation overlaps"), (["--load-in-4bit"], "Drop --load-in-4bit"),
     (["--algorithm", "ppo", "--generation-device", "cpu"], "--generation-device is for grpo and rloo"),
     (["--algorithm", "distillation", "--generation-device", "cpu"], "--generation-device is for grpo and rloo"),
     (["--teacher-steps", "0"], "--teacher-steps must be at least 1"),
     (["--teacher-adapter", "outputs/demo/adapter"], "use it with --algorithm distillation"),
     (["--algorithm", "distillation", "--teacher-adapter", "no/such/dir"], "holds no adapter_config.json")],
)  # fmt: skip
def test_invalid_demo_settings_exit_with_a_message(flags, message, capsys):
    assert main(["demo", "--model", "tiny", *flags]) == 2
    assert message in capsys.readouterr().err


def nan_from_step(monkeypatch, step: int) -> None:
    """Make slimrl's loss NaN from optimizer step `step` on (the step check then sees it)."""
    from slimrl import GRPOTrainer

    compute_loss = GRPOTrainer.compute_loss

    def loss_or_nan(self, *args, **kwargs):
        loss = compute_loss(self, *args, **kwargs)
        return loss * torch.nan if self.state.global_step + 1 >= step else loss

    monkeypatch.setattr(GRPOTrainer, "compute_loss", loss_or_nan)


def test_a_nonfinite_step_stops_the_demo_which_still_evaluates_saves_and_exits_1(tmp_path, monkeypatch, capsys):
    nan_from_step(monkeypatch, 2)
    out = tmp_path / "demo"
    assert main([*TINY_DEMO, "--output-dir", str(out)]) == 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["raised_nonfinite_error"] is True and metrics["status"] == "nonfinite_error"
    assert metrics["nonfinite_error"]["step"] == 2 and "not finite" in metrics["nonfinite_error"]["message"]
    assert metrics["nonfinite_error"]["during"] == "training" and metrics["adapter_saved"] is True
    assert [entry["step"] for entry in metrics["history"]] == [1]  # the step before it is kept
    assert (out / "adapter" / "adapter_config.json").is_file()
    after = metrics["accuracy_after"]  # evaluated after the stop, and printed as saved
    printed = capsys.readouterr().out
    assert accuracy_line("after: ", after) in printed
    assert "training stopped at step 2: NonFiniteError" in printed


def test_on_nonfinite_skip_skips_the_step_and_records_it(tmp_path, monkeypatch):
    nan_from_step(monkeypatch, 2)
    out = tmp_path / "demo"
    assert main([*TINY_DEMO, "--output-dir", str(out), "--on-nonfinite", "skip"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [entry["step"] for entry in metrics["history"]] == [1, 2]
    assert [entry["nonfinite_skipped"] for entry in metrics["history"]] == [0, 1]
    assert metrics["nonfinite_skipped_steps"] == [2] and metrics["raised_nonfinite_error"] is False
    assert metrics["settings"]["on_nonfinite"] == "skip"


def test_generation_backend_and_on_nonfinite_flags_reach_the_trainers_config(tmp_path):
    from slimrl import GRPOConfig
    from slimrl.cli.demo import DemoSettings, grpo_config_kwargs

    args = build_parser().parse_args(["demo", "--generation-backend", "engine", "--on-nonfinite", "skip"])
    settings = DemoSettings(**{k: v for k, v in vars(args).items() if k != "command"})
    config = GRPOConfig(**grpo_config_kwargs(settings, tmp_path, "cpu"))
    assert config.generation_backend == "engine" and config.on_nonfinite == "skip"
    defaults = build_parser().parse_args(["demo"])
    assert (defaults.generation_backend, defaults.on_nonfinite) == ("auto", "raise")


def test_the_demo_under_two_processes_trains_data_parallel_and_only_the_main_one_writes(tmp_path):
    # `accelerate launch --num_processes 2 -m slimrl.cli demo` on two H100s crashed when both ranks renamed the same
    # metrics file; every rank trains, the main one prints and writes, and the ranks end with the same adapter
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.bench.test_scaling_smoke import free_port

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "slimrl.cli", *TINY_DEMO, "--gradient-checkpointing", "--output-dir",
               str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("held-out accuracy before") == 1 and result.stdout.count("step   2/2  reward") == 1
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["processes"] == 2
    assert metrics["ranks_hold_the_same_adapter"] is True
    assert metrics["settings"]["gradient_checkpointing"] is True
    assert (out / "adapter" / "adapter_config.json").is_file() and not list(out.glob(".*.partial"))
