"""Rounding inside the training kernels as eager PyTorch rounds. Import only where Triton may be used."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter (the CPU tests) converts fp32 to bf16 by dropping the low bits; there the rounding to nearest
# is done by hand so the interpreter's results are the GPU's
_SOFT_BF16 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_bf16_bits(x):
    """fp32 `x` rounded to bf16 (to nearest, ties to even) on its bits, returned as fp32: integer operations, which
    neither the interpreter's truncating cast nor the GPU compiler's folding of a cast pair can change."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype` (to nearest, ties to even) and returned as fp32; a no-op for fp32."""
    if _SOFT_BF16 and dtype == tl.bfloat16:
        return round_bf16_bits(x)
    return x.to(dtype).to(tl.float32)
