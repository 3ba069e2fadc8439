"""The decode step's Triton kernels, one op per module: `attention`, `lora` (shrink/expand), `gemm` (the projections'
shared GEMM and LoRA epilogue pieces), `projections` (q/k/v + RoPE + cache write, and o / gate-up / down), `norm`
(residual add + RMSNorm), `moe` (a sparse block's routed experts), `sampler`; `common` holds what they share
(programmatic dependent launch, rounding, tiles).

Each has a plain-PyTorch reference (`slimrl.rollout.model.reference`, `slimrl.rollout.model.moe`,
`slimrl.rollout.sampling`) that the tests compare it with, on CUDA and, under TRITON_INTERPRET=1, on the CPU. The
modules import triton at import time; these two checks do not, so callers ask them first.
"""

from __future__ import annotations

import os

import torch


def available() -> bool:
    """Whether Triton is installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (the CPU tests set TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_here(x: torch.Tensor) -> bool:
    """Whether Triton kernels can take this tensor: on CUDA, or anywhere in the interpreter."""
    return x.is_cuda or interpreting()
