"""RMSNorm of the training forward as Triton kernels, with its backward, as an autograd Function.

Forward: one program per row; the row is normalised in fp32, rounded to the input dtype, then multiplied by the
weight in the output dtype (promote(weight, input)), as `slimrl.ops.fused.rms_norm_reference` (the model's
formula) rounds. The reciprocal RMS of each row is saved in fp32 ([tokens] floats), so the backward needs no second
reduction over the input before its own.

Backward: each program takes a contiguous run of rows, writes their input gradient and sums its rows' share of the
weight gradient in fp32 in registers; the shares ([programs, hidden] fp32) are added after the launch, so the
weight gradient needs no atomics and comes out the same run to run. Import only where Triton may be used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.ops.kernels.rounding import round_to

PROGRAMS_PER_SM = 4  # backward programs per SM: enough rows in flight, few weight-gradient shares to add


@triton.jit
def _rms_norm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, eps, BLOCK: tl.constexpr):
    X = x_ptr.dtype.element_ty
    Y = y_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = round_to(x * rstd, X)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * N + offs, round_to(w * normed, Y).to(Y), mask=ok)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, N, rows_per_program,
                              BLOCK: tl.constexpr, WEIGHT_GRAD: tl.constexpr):  # fmt: skip
    """dx = rstd (dn - n mean(dn n)) with n = x rstd and dn = dy w (rounded to the output dtype, as eager's product
    is); this program's share of dw = sum over its rows of dy * round(n) goes to row `program` of dw_ptr."""
    X = x_ptr.dtype.element_ty
    Y = dy_ptr.dtype.element_ty
    DX = dx_ptr.dtype.element_ty
    program = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    share = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, rows - first)):
        row = first + i
        at = row * N + offs
        dy = tl.load(dy_ptr + at, mask=ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        normed = x * rstd
        if WEIGHT_GRAD:
            share += dy * round_to(normed, X)
        grad_normed = round_to(dy * w, Y)
        dx = rstd * (grad_normed - normed * (tl.sum(grad_normed * normed, axis=0) / N))
        tl.store(dx_ptr + at, round_to(dx, DX).to(DX), mask=ok)
    if WEIGHT_GRAD:
        tl.store(dw_ptr + program.to(tl.int64) * N + offs, share, mask=ok)


def _programs(rows: int, device: torch.device) -> int:
    if device.type != "cuda":
        return min(rows, 3)  # the interpreter: a few shares, one of them short, exercise the same arithmetic
    return min(rows, PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


class RMSNormFunction(torch.autograd.Function):
    """y = weight * round(x * rstd(x)) over the last dimension; saves x, the weight and rstd ([rows] fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        flat = x.reshape(-1, width).contiguous()
        rows = flat.shape[0]
        out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(width)
        if rows:
            _rms_norm_forward_kernel[(rows,)](flat, weight.contiguous(), out, rstd, width, float(eps), BLOCK=block,
                                              num_warps=_warps(block))  # fmt: skip
        ctx.save_for_backward(flat, weight, rstd)
        ctx.shape = x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        flat, weight, rstd = ctx.saved_tensors
        rows, width = flat.shape
        grad = grad_out.reshape(rows, width).contiguous()
        dx = torch.empty_like(flat)
        programs = max(_programs(rows, flat.device), 1)
        weight_grad = ctx.needs_input_grad[1]
        shares = torch.empty((programs, width) if weight_grad else (1,), dtype=torch.float32, device=flat.device)
        block = triton.next_power_of_2(width)
        if rows:
            _rms_norm_backward_kernel[(programs,)](grad, flat, weight.contiguous(), rstd, dx, shares, rows, width,
                                                   triton.cdiv(rows, programs), BLOCK=block, WEIGHT_GRAD=weight_grad,
                                                   num_warps=_warps(block))  # fmt: skip
        dw = shares.sum(0).to(weight.dtype) if weight_grad and rows else None
        if weight_grad and not rows:
            dw = torch.zeros_like(weight)
        return dx.view(ctx.shape), dw, None


def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm through the kernels; the signature of `slimrl.ops.fused.rms_norm_reference`."""
    if weight.shape != hidden_states.shape[-1:]:
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} does not match hidden states of width "
                         f"{hidden_states.shape[-1]}; pass the norm's own weight")  # fmt: skip
    return RMSNormFunction.apply(hidden_states, weight, eps)
