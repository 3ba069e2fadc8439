"""The decode step's Triton kernels, one op per module: `attention`, `lora` (shrink/expand), `gemm` (the projections'
shared GEMM and LoRA epilogue pieces), `projections` (q/k/v + RoPE + cache write, and o / gate-up / down), `norm`
(residual add + RMSNorm), `moe` (a sparse block's routed experts), `router` (its top-k), `sampler`; `common` holds
what they share (programmatic dependent launch, rounding, tiles).

Each has a plain-PyTorch reference (`slimrl.rollout.model.reference`, `slimrl.rollout.model.moe`,
`slimrl.rollout.sampling`) that the tests compare it with, on CUDA and, under TRITON_INTERPRET=1, on the CPU. The
modules import triton at import time; these checks do not, so callers ask them first.
"""

from __future__ import annotations

import torch

# Triton installed, the interpreter on: the same checks as the training kernels'
from slimrl.ops.kernels import available, interpreting

__all__ = ["available", "interpreting", "runs_here"]


def runs_here(x: torch.Tensor) -> bool:
    """Whether Triton kernels can take this tensor: on CUDA, or anywhere in the interpreter."""
    return x.is_cuda or interpreting()
