"""slimrl's offloaded checkpoints under a bare DistributedDataParallel: DDP's reducer takes each weight's gradient
once per backward pass and, with find_unused_parameters=True (HF Trainer's choice for a PEFT model), looks for the
weights in the graph of the outputs. The checkpoint passes its layer's weights through its autograd node and returns
their gradients, summed over the MLP tiles, so on 2 CPU processes (gloo) DDP's gradients are the ranks' mean exactly,
tiled or not, searching for unused parameters or not. (Before issue 29 the recompute ran a backward of its own: with
the search on, every LoRA weight was marked unused and the first real gradient "marked as ready twice", the crash on
two H100s; with tiles, the second tile's gradient did the same.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.bench.test_scaling_smoke import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_ddp_reduces_the_offloaded_checkpoints_gradients_tiled_or_not(tmp_path):
    out = tmp_path / "tiles.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "-m", "tests.distributed.ddp_tiles", str(out)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    logs = json.loads(out.read_text())
    assert logs["num_processes"] == 2 and logs["distributed_type"] == "DistributedType.MULTI_CPU"
    cases = [f"tile={tile},find_unused={find}" for tile in (0, 4) for find in (True, False)]
    for case in cases:
        assert logs[case]["ran"], f"{case}: {logs[case].get('error')}"
        assert logs[case]["scale"] > 0
        assert logs[case]["max_abs_difference"] <= 1e-6 * logs[case]["scale"], case  # fp32 mean of two ranks
    # the reason slimrl's configs refuse ddp_static_graph=True
    assert not logs["static_graph_after_no_sync"]["ran"]
    assert "expect_autograd_hooks_" in logs["static_graph_after_no_sync"]["error"]
