"""The examples run end to end in smoke mode (`--smoke`: slimrl.testing's tiny model, a step or two, on the CPU).

The three runs share one subprocess: each runs as `__main__`, as `python examples/<file>.py ...` would, but the
imports of torch, transformers and TRL (most of a smoke run's time on a 2-core machine) are paid once, not three times.
A subprocess keeps `PatchFastRL`'s patching of TRL out of the test process.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "=== example run: "
RUNS = {
    "sft": ["offline_arithmetic.py", "sft", "--smoke"],
    "dpo": ["offline_arithmetic.py", "dpo", "--smoke", "--steps", "2"],  # a flag beside --smoke still applies
    "ppo": ["ppo_arithmetic.py", "--smoke", "--ppo-epochs", "2"],
}
# Runs each example file as __main__ with its command line, printing a marker line before each.
DRIVER = """
import json, runpy, sys
for name, argv in json.loads(sys.argv[1]).items():
    print({mark!r} + name, flush=True)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{run name: (its printed lines, its output directory)} from one subprocess running every example."""
    out = tmp_path_factory.mktemp("examples")
    argvs = {name: [str(ROOT / "examples" / argv[0]), *argv[1:], "--output-dir", str(out / name)]
             for name, argv in RUNS.items()}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-c", DRIVER.format(mark=MARK), json.dumps(argvs)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = {}
    for chunk in result.stdout.split(MARK)[1:]:
        name, _, lines = chunk.partition("\n")
        printed[name] = lines.splitlines()
    assert printed.keys() == RUNS.keys(), result.stdout[-3000:]
    return {name: (printed[name], out / name) for name in RUNS}


def final_result(lines: list[str]) -> dict:
    """The dict an example prints last (its `main`'s return value)."""
    return ast.literal_eval(lines[-1])


@pytest.mark.parametrize(("name", "steps"), [("sft", 1), ("dpo", 2)])
def test_offline_example_trains_evaluates_and_saves_the_adapter(runs, name, steps):
    lines, out = runs[name]
    result = final_result(lines)
    assert result["algorithm"] == name and result["steps"] == steps and result["train_seconds"] > 0
    for when in ("before", "after"):  # k of the 4 held-out problems
        assert result[f"accuracy_{when}"] * 4 in {0.0, 1.0, 2.0, 3.0, 4.0}
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_ppo_example_runs_a_rollout_steps_and_saves_the_policy_and_value_head(runs):
    lines, out = runs["ppo"]
    result = final_result(lines)
    assert result["rollouts"] == 1 and result["optimizer_steps"] == 2 and result["device"] == "cpu"
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1", "2"]
    assert any(line.startswith("held-out accuracy before:") for line in lines)
    assert any(line.startswith("held-out accuracy after:") for line in lines)
    assert (out / "adapter_config.json").is_file() and (out / "value_head.safetensors").is_file()
