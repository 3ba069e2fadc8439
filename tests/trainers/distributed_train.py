"""Run by test_grpo_distributed.py under `accelerate launch --cpu --num_processes 2`: trains TRL's and slimrl's
GRPO trainers with DistributedDataParallel (gloo) from the same seed and writes rank 0's logs as JSON."""

import json
import sys
import warnings

warnings.simplefilter("ignore")

from tests.trainers.test_grpo_train_parity import train_log  # noqa: E402

if __name__ == "__main__":
    out_path = sys.argv[1]
    config = dict(per_device_train_batch_size=4, num_generations=4, loss_type="dapo", beta=0.04, num_iterations=2)
    logs = {"trl": train_log("trl", **config), "slimrl": train_log("slimrl", num_chunks=2, **config)}
    from accelerate import PartialState

    state = PartialState()
    if state.is_main_process:
        logs["num_processes"] = state.num_processes
        with open(out_path, "w") as f:
            json.dump(logs, f)
    # tear the gloo group down before the interpreter does: left to exit, its threads can be destroyed while still
    # joinable, and a rank then aborts ("terminate called without an active exception", seen once in CI)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
