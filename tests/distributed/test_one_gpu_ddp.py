"""slimrl's GRPO step under data parallel on the GPU, without a second GPU: two processes share cuda:0 over gloo, with
the whole CUDA path on (engine per rank, offloaded checkpoints in pinned memory, MLP tiles, fused ops, two chunks).
At 2cfc6ac it raised "marked as ready twice" at its first step, as on two H100s (issue 29). See one_gpu_ddp.py.
Collected by scripts/gpu_check.sh. FSDP2 cannot run this way: with two processes on one H100 over gloo both ranks
died of SIGSEGV before the first step (torch 2.11, measured); its parity with TRL is tested on 2 CPU processes
(test_sharded_training.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.test_scaling_smoke import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cuda


def run_two_ranks(out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "tests.distributed.one_gpu_ddp", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    logs = json.loads(out.read_text()) if out.exists() else {}
    assert result.returncode == 0 and logs.get("ran"), (
        logs.get("traceback") or logs.get("error") or result.stderr[-4000:]
    )
    return logs


def assert_trained_on_the_cuda_path(logs: dict) -> None:
    assert logs["device"] == "cuda:0" and logs["num_processes"] == 2
    assert len(logs["losses"]) == 3 and all(math.isfinite(x) for x in logs["losses"] + logs["grad_norms"])
    assert any(norm > 0 for norm in logs["grad_norms"])
    # every checkpoint went through pinned host memory on one side stream, and the layers were recomputed in parts
    assert logs["offloaded"] > 0 and logs["side_streams"] == 1 and logs["split_recomputes"] > 0
    assert logs["calls"]["mlp_forward"] > 0 and logs["calls"]["norm_forward"] > 0  # the fused element-wise ops
    assert logs["calls"]["generate"] >= 3  # every step's rollouts came from this rank's engine


def test_grpo_under_ddp_with_two_processes_on_one_gpu(tmp_path):
    logs = run_two_ranks(tmp_path / "ddp.json")
    assert logs["wrapper"] == "DistributedDataParallel"
    assert_trained_on_the_cuda_path(logs)
    assert logs["mlp_tile_tokens"] == 16  # the MLP tiles stay on under DDP
    assert logs["ranks_identical"] and logs["weights_numel"] > 0  # gradients all-reduced: the same update on both
    # the layer passes whose shapes repeated (the two chunks of a micro-batch) were captured and replayed, the
    # weights' gradients still reaching DDP's reducer once per pass
    assert logs["graphs"]["failures"] == 0 and logs["graphs"]["captures"] > 0 and logs["graphs"]["replays"] > 0

