"""bench/scaling.py on the CPU: with no launcher (N = 1) both sides run, each step split into phases with completion
tokens per second over all ranks and no weight sync; under torchrun with 2 processes (DDP over gloo) the same script
reports world size 2 and twice the N = 1 run's prompts per step. The N = 1 runs call the script's main in this
process, as the other bench smoke tests do (its exit status is main's report's); the N = 2 run's two ranks are forked
with torchrun's environment (tests/distributed/launch.py; the demo's two-process test in test_cli.py is the one run
under torch.distributed.run itself)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "scaling.py"
NO_SYNC_NOTE = "engine shares the training weights (no sync)"


def run_main(argv: list[str]) -> dict:
    """`python bench/scaling.py ARGV` without a launcher, run in this process: the report it saved, once its exit
    status (main's report's) is 0."""
    spec = importlib.util.spec_from_file_location("bench_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = module.main(argv)
    assert report.exit_status() == 0, report["problems"]
    return json.loads(Path(argv[0]).read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    return run_main([str(out), "--tiny", "--steps", "2", "--trl-steps", "1"])


def test_one_process_times_both_sides_with_tokens_per_second_and_no_sync(single):
    assert single["problems"] == [] and single["world_size"] == 1 and single["distributed_type"] == "NO"
    assert set(single["versions"]) >= {"torch", "transformers", "trl", "peft", "accelerate"}
    assert single["gpu"] == "cpu" and "--tiny" in single["command"]
    assert list(single["sides"]) == ["slimrl", "trl"]
    for kind, steps in (("slimrl", 2), ("trl", 1)):
        side = single["sides"][kind]
        assert side["status"] == "ok", side.get("error")
        assert side["world_size"] == 1 and side["steps_run"] == len(side["steps"]) == steps
        assert side["sync_bytes"] == 0 and side["sync_note"] == NO_SYNC_NOTE
        assert side["peak_GiB_per_rank"] is None  # no CUDA
        for step in side["steps"]:
            assert step["generation_s"] > 0 and step["training_s"] > 0, (kind, step)
            assert step["completion_tokens"] > 0 and step["tokens_per_s"] > 0, (kind, step)
            assert step["sync_bytes"] == 0 and step["peak_GiB_per_rank"] is None
        assert side["tokens_per_s"]["mean_all"] > 0
    assert single["sides"]["slimrl"]["prompts_per_step"] == single["settings"]["prompts_per_step"] == 1


def test_two_processes_double_the_prompts_per_step(single, tmp_path):
    from tests.distributed.launch import run_two_processes

    out = tmp_path / "scaling_n2.json"
    # torchrun's environment on two ranks (forked from the preloaded server): accelerate runs DDP over gloo on the CPU
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    run_two_processes(str(SCRIPT), [str(out), "--tiny", "--sides", "slimrl", "--steps", "1"], free_port(), env=env,
                      timeout=300, cwd=ROOT)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["problems"] == [] and report["world_size"] == 2 and report["distributed_type"] == "MULTI_CPU"
    assert list(report["sides"]) == ["slimrl"]
    side = report["sides"]["slimrl"]
    assert side["status"] == "ok" and side["world_size"] == 2 and side["steps_run"] == 1, side.get("error")
    per_rank = single["sides"]["slimrl"]["prompts_per_step_per_rank"]
    assert side["prompts_per_step"] == report["settings"]["prompts_per_step"] == 2 * per_rank
    assert side["completions_per_step"] == 2 * single["sides"]["slimrl"]["completions_per_step"]
    (step,) = side["steps"]
    assert step["generation_s"] > 0 and step["training_s"] > 0 and step["tokens_per_s"] > 0
    one_rank_at_most = report["settings"]["num_generations"] * report["settings"]["completion_length"]
    assert step["completion_tokens"] > one_rank_at_most  # summed over both ranks (deterministic on the CPU)


def test_a_global_batch_of_two_prompts_on_one_process_with_hf_generate(tmp_path):
    # the 1-GPU half of issue 22's same-global-batch comparison: both prompts of a step on the one rank
    out = tmp_path / "batch_n1.json"
    report = run_main([str(out), "--tiny", "--sides", "slimrl", "--steps", "1", "--prompts-per-step", "2",
                       "--generation-backend", "transformers"])  # fmt: skip
    assert report["problems"] == []
    settings, side = report["settings"], report["sides"]["slimrl"]
    assert settings["prompts_per_step"] == settings["prompts_per_step_per_rank"] == 2
    assert settings["generation_backend"] == "transformers" and side["generation_backend"] == "transformers"
    assert side["status"] == "ok" and side["completions_per_step"] == 16 and side["prompts_per_step"] == 2
    (step,) = side["steps"]
    assert step["completion_tokens"] > settings["num_generations"] * settings["completion_length"]  # both groups


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import scaling

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="does not split evenly over 2 processes"):
        scaling.main([str(tmp_path / "x.json"), "--tiny", "--prompts-per-step", "3"])
    with pytest.raises(SystemExit):
        scaling.parse_args(["--tiny", "--full-finetune", "--full-dtype", "fp32"])
