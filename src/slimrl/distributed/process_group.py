"""The end of a run under a launcher (`accelerate launch`, torchrun): its default process group is destroyed before the
interpreter exits, after every rank has reached the end. Left to the exit, NCCL's group makes PyTorch warn on every
run that destroy_process_group() was never called, and gloo's threads can abort a rank that is still tearing down."""

from __future__ import annotations

import torch.distributed as dist


def end_launcher_group() -> bool:
    """Wait for every rank, then destroy the default process group; False (and nothing done) without one. Call it
    at the end of an entry point, once no collective is left: not after a rank failed, whose peers would wait at the
    barrier until the group's timeout (the launcher ends them sooner)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True
