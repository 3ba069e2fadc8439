"""slimrl's offloaded checkpoints under a bare DistributedDataParallel: DDP's reducer takes each weight's gradient
once per backward pass and, with find_unused_parameters=True (HF Trainer's choice for a PEFT model), looks for the
weights in the graph of the outputs. The checkpoint passes its layer's weights through its autograd node and returns
their gradients, summed over the MLP tiles, so on 2 CPU processes (gloo) DDP's gradients are the ranks' mean exactly,
tiled or not, searching for unused parameters or not. (Before issue 29 the recompute ran a backward of its own: with
the search on, every LoRA weight was marked unused and the first real gradient "marked as ready twice", the crash on
two H100s; with tiles, the second tile's gradient did the same.)"""

from __future__ import annotations

import json

from tests.bench.test_scaling_smoke import free_port
from tests.distributed.launch import run_two_processes


def test_ddp_reduces_the_offloaded_checkpoints_gradients_tiled_or_not(tmp_path):
    out = tmp_path / "tiles.json"
    run_two_processes("tests.distributed.ddp_tiles", [str(out)], free_port(), timeout=300)
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
