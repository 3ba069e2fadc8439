"""Why slimrl's trainers recompute the MLP untiled under DDP (chunked_trainer.mlp_tile_tokens_for): DDP's reducer
takes each weight's gradient once per backward pass, and the offloaded checkpoints' split recompute backpropagates
each MLP tile on its own. On 2 CPU processes (gloo): untiled, DDP's gradients are the ranks' mean exactly; tiled,
DDP raises "marked ready only once" (what W3 hit on two H200s before the fix, issue 22)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench.test_scaling_smoke import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_ddp_takes_the_untiled_recompute_and_refuses_tiles(tmp_path):
    out = tmp_path / "tiles.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "tests.distributed.ddp_tiles", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    logs = json.loads(out.read_text())
    assert logs["num_processes"] == 2 and logs["distributed_type"] == "DistributedType.MULTI_CPU"
    untiled, tiled = logs["0"], logs["4"]
    assert untiled["ran"] and untiled["scale"] > 0
    assert untiled["max_abs_difference"] <= 1e-6 * untiled["scale"]  # fp32 mean of two ranks: exact here
    assert not tiled["ran"] and "ready only once" in tiled["error"]
