"""Triton kernels of the training forward and backward, one op per module: `glu` (the SiLU / GELU-tanh gated product
of the MLP, forward, and backward in place), `rms_norm` (RMSNorm forward and backward, as an autograd Function);
`rounding` holds the rounding helper they share.

Each has a plain-PyTorch reference (`slimrl.ops.fused.silu_mul_reference`, `rms_norm_reference`, and the GELU-tanh
product in `slimrl.ops.lora_mlp`) that the tests compare it with, on CUDA and, under TRITON_INTERPRET=1, on the CPU.
The modules import triton at import time; these checks do not, so callers ask them first.
"""

from __future__ import annotations

import os

import torch

# dtypes the kernels take (fp64 runs the PyTorch reference: gradcheck's dtype, never a training dtype)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    """Whether the training kernels take this tensor: Triton installed, a kernel dtype, and on CUDA or anywhere in
    the interpreter."""
    return x.dtype in KERNEL_DTYPES and (x.is_cuda or interpreting()) and available()
