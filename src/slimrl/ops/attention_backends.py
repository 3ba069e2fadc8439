"""Which SDPA backends slimrl's training forward and backward may use, chosen deliberately.

cuDNN's SDPA backward returns NaN gradients when an explicit attention mask is passed, the sequence length is 64 mod
128 and some query row's logsumexp is below about -88.7 (a fully masked row from left padding, or a head with huge
negative logits even under an all-True mask). Seen with torch 2.11 + cuDNN 9.19 on an H100 and reported for torch 2.13
(pytorch/pytorch#196678; huggingface/trl#7181 for DPO/KTO). The forward is finite, so nothing warns: the optimizer
writes the NaN into the weights. `training_attention()` turns the cuDNN backend off for the span of slimrl's own
training step (forward, gradient-checkpoint recompute and backward all run inside it) and restores the user's
setting afterwards; the memory-efficient and flash backends, which SDPA picks instead, are clean at those shapes.

No fixed torch release is known, so the guard applies to every version with a cuDNN SDPA backend. Its cost is
measured in bench/ (docs/benchmarks.md). `SLIMRL_ALLOW_CUDNN_SDPA=1` leaves cuDNN's backend on (for a torch where
the bug is fixed: tests/ops/test_attention_backends.py checks the shapes that break it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

ALLOW_ENV = "SLIMRL_ALLOW_CUDNN_SDPA"


def cudnn_sdpa_avoided() -> bool:
    """Whether `training_attention` turns cuDNN's SDPA off (the default, unless SLIMRL_ALLOW_CUDNN_SDPA=1)."""
    return os.environ.get(ALLOW_ENV) != "1"


@contextlib.contextmanager
def training_attention() -> Iterator[None]:
    """cuDNN's SDPA backend off inside the block (other backends as the user set them), restored on exit.

    The flag is torch's global one (the backward runs on autograd's own thread, which reads it too), so the block must
    span the forward and the backward of the step; it is never left flipped after the block.
    """
    if not cudnn_sdpa_avoided():
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
