"""The decode step's residual add + RMSNorm in one Triton launch, so it takes part in the step's programmatic dependent
launches (a compiled norm cannot). Reference: `slimrl.rollout.model.reference.add_rms_norm`.
Import this module only where Triton may be used: it imports triton at import time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.rollout.kernels.common import enter, round_to
from slimrl.rollout.kernels.common import options as launch_options


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, ADD: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    """One row: h + d rounded to h's dtype (stored), then LlamaRMSNorm of it (fp32 statistics, the normalised row
    rounded to h's dtype, times the weight in the output's dtype)."""
    enter(PDL)
    OUT = h_out_ptr.dtype.element_ty
    Y = y_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    h = tl.load(h_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    if ADD:
        h = round_to(h + tl.load(d_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32), OUT)
        tl.store(h_out_ptr + row * N + offs, h.to(OUT), mask=ok)
    normed = round_to(h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps), OUT)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, (w * normed).to(Y), mask=ok)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(hidden + delta, its RMSNorm) as `llama.add_rms_norm` computes them, in one launch; with delta None,
    (hidden, its RMSNorm). hidden and delta [M, N] contiguous of one dtype, weight [N]."""
    rows, width = hidden.shape
    out = torch.empty_like(hidden) if delta is not None else hidden
    normed = torch.empty(rows, width, dtype=torch.promote_types(weight.dtype, hidden.dtype), device=hidden.device)
    block = triton.next_power_of_2(width)
    _add_rms_norm_kernel[(rows,)](
        hidden, delta if delta is not None else hidden, weight, out, normed, width, float(eps), BLOCK=block,
        ADD=delta is not None, num_warps=4 if block <= 2048 else 8, **launch_options(hidden.device),
    )  # fmt: skip
    return out, normed

