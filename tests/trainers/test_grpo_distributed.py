"""Data-parallel training through accelerate (2 CPU processes, gloo): slimrl's chunked step, whose inner backward
passes skip the gradient all-reduce, logs the same curve as TRL's, also with an engine per rank generating half of
each prompt's group."""

from __future__ import annotations

import json

from tests.distributed.launch import run_two_processes
from tests.trainers.test_grpo_train_parity import assert_same_curves


def test_two_process_ddp_training_matches_trl(tmp_path):
    out = tmp_path / "logs.json"
    # each rank gets torchrun's RANK/WORLD_SIZE; accelerate (inside the trainers) then runs DDP over gloo on the CPU
    run_two_processes("tests.trainers.distributed_train", [str(out)], 29533, timeout=600)
    logs = json.loads(out.read_text())
    assert logs["num_processes"] == 2
    assert_same_curves(logs["trl"], logs["slimrl"])
    assert_same_curves(logs["trl_split_group"], logs["slimrl_engine_split_group"])
    assert len(logs["slimrl_engine_split_group"]) > 1
