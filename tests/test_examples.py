"""The examples run end to end in smoke mode (`--smoke`: slimrl.testing's tiny model, a step or two, on the CPU).

The runs share one subprocess: each runs as `__main__`, as `python examples/<file>.py ...` would, but the imports
of torch, transformers and TRL (most of a smoke run's time on a 2-core machine) are paid once, not once per run.
A subprocess keeps `PatchFastRL`'s patching of TRL out of the test process.
"""

import ast
import json
import math
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
    "distillation": ["distillation_arithmetic.py", "--smoke"],
    "bco": ["bco_feedback.py", "--smoke"],
    "prm": ["prm_steps.py", "--smoke"],
    "xpo": ["xpo_arithmetic.py", "--smoke"],
}
# Runs each example file as __main__ with its command line, printing a marker line before each; the examples' folder
# goes first on the path, as `python examples/<file>.py` puts it (they import their sibling example_setup.py).
DRIVER = """
import json, os, runpy, sys
for name, argv in json.loads(sys.argv[1]).items():
    print({mark!r} + name, flush=True)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(argv[0]))
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


def logged_steps(lines: list[str]) -> int:
    """How many optimizer steps TRL's printer logged (logging_steps=1 in the smoke runs: one dict with a loss each)."""
    return sum(line.startswith("{'loss': ") for line in lines)


def finite(*values) -> bool:
    return all(isinstance(value, float) and math.isfinite(value) for value in values)


def test_distillation_example_distils_a_student_from_its_sft_teacher_and_saves_the_adapter(runs):
    lines, out = runs["distillation"]
    result = final_result(lines)
    assert result["steps"] == 2 == logged_steps(lines) and result["train_seconds"] > 0
    # the teacher (1 SFT step, merged) differs from the student's base, so there is a divergence to learn
    assert finite(result["divergence_first_step"], result["divergence_last_step"])
    assert result["divergence_first_step"] > 0
    for key in ("teacher_accuracy", "accuracy_before", "accuracy_after"):  # k of the 4 held-out problems
        assert result[key] * 4 in {0.0, 1.0, 2.0, 3.0, 4.0}
    assert f"held-out accuracy: teacher {result['teacher_accuracy']:.0%}, student before" in "\n".join(lines)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_bco_example_trains_on_thumbs_from_the_rewards_of_its_own_samples(runs):
    lines, out = runs["bco"]
    result = final_result(lines)
    assert result["steps"] == 2 == logged_steps(lines)
    assert result["feedback_rows"] == 16  # 4 problems x 4 samples
    up = round(result["thumbs_up_share"] * 16)  # balanced: as many thumbs-down as thumbs-up, unless one is missing
    assert result["train_rows"] == (2 * min(up, 16 - up) if 0 < up < 16 else 16)
    assert finite(result["loss_first"], result["loss_last"], result["delta_last"])
    # BCO's loss is -log sigmoid(+-(r - delta)): log 2 at the first step, where the policy is its reference
    assert math.isclose(result["loss_first"], math.log(2), rel_tol=1e-4)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_prm_example_scores_worked_steps_and_saves_the_adapter_with_its_head(runs):
    from safetensors import safe_open

    lines, out = runs["prm"]
    result = final_result(lines)
    assert result["steps"] == 2 == logged_steps(lines)
    for key in ("correct_step_share", "step_accuracy_before", "step_accuracy_after"):  # k of 4 solutions x 3 steps
        assert round(result[key] * 12, 6) in set(map(float, range(13))), (key, result[key])
    assert finite(result["eval_loss_before"], result["eval_loss_after"], result["loss_first_log"])
    with safe_open(out / "adapter_model.safetensors", "pt") as saved:  # the fresh head is saved with the LoRA
        assert any(".score." in key for key in saved.keys())


def test_xpo_example_pairs_policy_and_reference_samples_scored_by_the_arithmetic_rewards(runs):
    lines, out = runs["xpo"]
    result = final_result(lines)
    assert result["steps"] == 2 == logged_steps(lines)
    scores = [result[f"{who}_score_{when}"] for who in ("policy", "reference") for when in ("first", "last")]
    assert finite(*scores, result["loss_dpo_last"])
    assert all(0.0 <= score <= 2.0 for score in scores)  # the mean of two rewards of 0 or 1
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
