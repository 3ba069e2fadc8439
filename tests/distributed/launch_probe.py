"""Worker of test_launch.py, run by launch.py's `run_two_processes`: `ok OUT_DIR` joins the gloo group through
env:// and writes, per rank, what a torchrun worker would see (its environment, argv, working directory, torch's
thread count, the first draws of its random generators); `fail OUT_DIR` makes rank 1 raise while rank 0 waits for it
in a barrier that never completes.

usage: python -m tests.distributed.launch_probe {ok|fail} OUT_DIR
"""

import json
import os
import random
import sys

import numpy
import torch
import torch.distributed as dist

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID",
         "OMP_NUM_THREADS"]  # fmt: skip

if __name__ == "__main__":
    mode, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if mode == "fail" and dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    seen = {
        "env": {name: os.environ.get(name) for name in NAMES},
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "draws": [torch.rand(1).item(), float(numpy.random.rand()), random.random()],
        "world": dist.get_world_size(),
    }
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
