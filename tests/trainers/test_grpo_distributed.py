"""Data-parallel training through accelerate (2 CPU processes, gloo): slimrl's chunked step, whose inner backward
passes skip the gradient all-reduce, logs the same curve as TRL's, also with an engine per rank generating half of
each prompt's group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.trainers.test_grpo_train_parity import assert_same_curves

ROOT = Path(__file__).resolve().parents[2]


def test_two_process_ddp_training_matches_trl(tmp_path):
    out = tmp_path / "logs.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    # torchrun sets RANK/WORLD_SIZE; accelerate (inside the trainers) then runs DDP over gloo on the CPU
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
               "-m", "tests.trainers.distributed_train", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    logs = json.loads(out.read_text())
    assert logs["num_processes"] == 2
    assert_same_curves(logs["trl"], logs["slimrl"])
    assert_same_curves(logs["trl_split_group"], logs["slimrl_engine_split_group"])
    assert len(logs["slimrl_engine_split_group"]) > 1
