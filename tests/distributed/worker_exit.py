"""The end of every multi-process test worker: rank 0 writes the logs, then each rank leaves without running the
interpreter's teardown.

A gloo rank that left teardown to the interpreter aborted twice in CI ("terminate called without an active exception",
SIGABRT) *after* its work was done, even with the group destroyed first: native worker threads were destroyed during
finalization (the same failure as pytorch/pytorch#179291 describes). Nothing of the code under test runs then, so the
worker writes its results, meets the other ranks, destroys the group, flushes and exits at once. A crash or a hang
*during* training still fails the test: the parent checks the exit code and reads the logs.
"""

from __future__ import annotations

import json
import os
import sys


def write_logs_and_exit(logs: dict, out_path: str) -> None:
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState()
    if state.is_main_process:
        logs["num_processes"] = state.num_processes
        logs["distributed_type"] = str(state.distributed_type)
        with open(out_path, "w") as f:
            json.dump(logs, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
