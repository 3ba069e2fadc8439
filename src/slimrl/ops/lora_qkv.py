"""An attention block's q, k and v LoRA projections of one input as one autograd Function with a hand-derived
backward, the rotary embedding of q and k applied in place.

Forward, per call (x [N, hidden]; Q, K, V the projections' widths; R = r_q + r_k + r_v):
    shrunk = x [A_q; A_k; A_v]^T                 [N, R]   the three LoRA shrinks in ONE GEMM
    q      = x W_q^T + b_q + s_q shrunk_q B_q^T   [N, Q]   the LoRA term added inside its GEMM; k and v likewise
    q, k   = rotated in place                     one launch for both (ops/kernels/rope.py); eager's bits
Saved: x, shrunk, the stacked A (small) and the weights. Three `lora_linear` calls save x three times (as views of
one tensor, so the memory is the same) and the rotation is a node of its own.

Backward (dq, dk, dv; q's and k's first rotated back, one launch):
    G   = [s_q dq B_q, s_k dk B_k, s_v dv B_v]      [N, R]  three GEMMs into column slices of one buffer
    [dA_q; dA_k; dA_v] = G^T x                      one GEMM
    dB_q = s_q dq^T shrunk_q  (k, v likewise)       the scale as the GEMM's alpha
    dX  = dq W_q + dk W_k + dv W_v + G [A_q; A_k; A_v]   four GEMMs into one buffer
Per layer and pass that is one autograd node where there were four (three projections and the rotation), and about
a dozen launches fewer: no separate scale multiplications, no sums of three input gradients, one shrink GEMM and one
dA GEMM instead of three each.

Base weights stay frozen; a 4-bit base is dequantised in the forward and again in the backward, one projection at a
time. Dtypes as in `slimrl.ops.lora_linear` (one compute dtype; autocast's when on). The rotation runs in the kernels
where they run (CUDA, or Triton's interpreter) and as `ops.rope`'s reference elsewhere; a rotary embedding the fused
path does not take (another dtype, another layout, cos or sin needing a gradient) is applied after the Function by
`ops.rope.rope`. `lora_qkv_reference` is peft's three projections and transformers' rotation in plain PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from slimrl.ops import kernels
from slimrl.ops.lora_linear import (
    LoRAProjection,
    check_frozen,
    compute_dtype,
    full_weight,
    function_inputs,
    lora_linear_reference,
    project,
    scaled_mm,
)
from slimrl.ops.rope import rope, rope_backward_reference, rope_reference


class _Spec(NamedTuple):
    """The Function's non-tensor arguments: per projection (q, k, v) its scale and dequantize callable; with a fused
    rotation, x's leading shape (batch, tokens), the head dim and whether the kernels run it."""

    scales: tuple[float, float, float]
    dequantize: tuple[Callable | None, Callable | None, Callable | None]
    rows: tuple[int, int] | None  # None: no rotation inside the Function
    head_dim: int
    kernel: bool


def lora_qkv_reference(x: torch.Tensor, q: LoRAProjection, k: LoRAProjection, v: LoRAProjection, head_dim: int,
                       cos: torch.Tensor | None = None, sin: torch.Tensor | None = None):  # fmt: skip
    """(query, key, value) of x [batch, tokens, hidden] as [batch, tokens, heads, head_dim]: peft's three LoRA
    Linears, then (with cos and sin) transformers' rotation of query and key."""
    shape = (*x.shape[:-1], -1, head_dim)
    query, key, value = (lora_linear_reference(x, p).view(shape) for p in (q, k, v))
    if cos is not None:
        query, key = rope_reference(query, key, cos, sin)
    return query, key, value


def lora_qkv(x: torch.Tensor, q: LoRAProjection, k: LoRAProjection, v: LoRAProjection, head_dim: int,
             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None):  # fmt: skip
    """The fused q, k and v projections of x [..., hidden], each returned as [..., heads, head_dim] in the compute
    dtype (see `lora_linear.compute_dtype`); with cos and sin ([batch or 1, tokens, head_dim], the model's rotary
    embedding) query and key come rotated."""
    for name, projection in (("q", q), ("k", k), ("v", v)):
        check_frozen(projection, name)
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    dtype = compute_dtype(x)
    tensors = [t for p in (q, k, v) for t in function_inputs(p, dtype)]
    inside = cos is not None and _rotation_fits(x, cos, sin, dtype, head_dim)
    flat = x.to(dtype).reshape(-1, x.shape[-1])
    spec = _Spec((float(q.scale), float(k.scale), float(v.scale)), (q.dequantize, k.dequantize, v.dequantize),
                 tuple(x.shape[:-1]) if inside else None, head_dim, inside and kernels.runs_here(flat))  # fmt: skip
    with torch.autocast(x.device.type, enabled=False):
        outs = LoRAQKVFunction.apply(flat, spec, cos if inside else None, sin if inside else None, *tensors)
    query, key, value = (out.view(*x.shape[:-1], -1, head_dim) for out in outs)
    if cos is not None and not inside:
        query, key = rope(query, key, cos, sin)
    return query, key, value


def _rotation_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the Function rotates in place: x [batch, tokens, hidden], cos and sin [batch or 1, tokens, head_dim]
    in the compute dtype on x's device, needing no gradient, and an even head dim."""
    if x.dim() != 3 or cos.dim() != 3 or cos.shape != sin.shape or cos.requires_grad or sin.requires_grad:
        return False
    batch, tokens = x.shape[:2]
    return (cos.shape[0] in (1, batch) and tuple(cos.shape[1:]) == (tokens, head_dim) and head_dim % 2 == 0
            and cos.dtype == sin.dtype == dtype and cos.device == x.device)  # fmt: skip


def _rotate(q: torch.Tensor, k: torch.Tensor, cos, sin, spec: _Spec, backward: bool):
    """q and k [N, width] rotated (backward: their gradients rotated back); the forward's kernel writes in place."""
    batch, tokens = spec.rows
    q4, k4 = (t.reshape(batch, tokens, -1, spec.head_dim) for t in (q, k))  # views of the forward's contiguous q, k
    if spec.kernel:
        from slimrl.ops.kernels.rope import rotate_, unrotate

        if not backward:
            rotate_(q4, k4, cos, sin)
            return q, k
        q4, k4 = unrotate(q4, k4, cos, sin)
    else:
        q4, k4 = (rope_backward_reference if backward else rope_reference)(q4, k4, cos, sin)
    return q4.reshape(q.shape), k4.reshape(k.shape)


class LoRAQKVFunction(torch.autograd.Function):
    """x [tokens, hidden] -> (q [tokens, Q], k [tokens, K], v [tokens, V]). Tensors after `spec`, cos and sin (None
    without a rotation): per projection (q, k, v) weight, bias (or None), lora_a, lora_b, all in x's dtype but a
    packed weight. Saves x, the shrinks and the stacked A."""

    @staticmethod
    def forward(ctx, x, spec: _Spec, cos, sin, *tensors):
        groups = [tensors[i : i + 4] for i in (0, 4, 8)]
        stacked = torch.cat([group[2] for group in groups])  # [R, hidden], small
        shrunk = x @ stacked.t()  # [N, R]
        outs, start = [], 0
        for (weight, bias, lora_a, lora_b), scale, dequantize in zip(groups, spec.scales, spec.dequantize,
                                                                         strict=True):  # fmt: skip
            rank = lora_a.shape[0]
            outs.append(project(x, full_weight(weight, dequantize, x.dtype), bias, shrunk[:, start : start + rank],
                                lora_b, scale))  # fmt: skip
            start += rank
        if spec.rows is not None:
            outs[0], outs[1] = _rotate(outs[0], outs[1], cos, sin, spec, backward=False)
        ctx.spec = spec
        ctx.save_for_backward(x, shrunk, stacked, cos, sin, *tensors)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, shrunk, stacked, cos, sin, *tensors = ctx.saved_tensors
        spec, need = ctx.spec, ctx.needs_input_grad[4:]  # need: per tensor after sin, as in `tensors`
        groups = [tensors[i : i + 4] for i in (0, 4, 8)]
        with torch.autocast(x.device.type, enabled=False):  # a recompute's backward may run under autocast
            grads = [x.new_zeros(x.shape[0], group[3].shape[0]) if g is None else g.to(x.dtype)
                     for g, group in zip(grads, groups, strict=True)]  # fmt: skip
            if spec.rows is not None:
                grads[0], grads[1] = _rotate(grads[0], grads[1], cos, sin, spec, backward=True)
            scaled, per_projection = _lora_grads(x, shrunk, grads, groups, spec, need)
            grad_x = None
            if ctx.needs_input_grad[0]:  # dq W_q + dk W_k + dv W_v + G [A_q; A_k; A_v], in one buffer
                for grad, (weight, *_), dequantize in zip(grads, groups, spec.dequantize, strict=True):
                    full = full_weight(weight, dequantize, x.dtype)
                    grad_x = grad @ full if grad_x is None else grad_x.addmm_(grad, full)
                    del full  # a dequantised base goes before the next one is made
                grad_x.addmm_(scaled, stacked)
        return (grad_x, None, None, None, *per_projection)


def _lora_grads(x, shrunk, grads, groups, spec: _Spec, need):
    """(G [N, R], [None, d bias, dA, dB] per projection); `need` as the Function's, for the tensors."""
    scaled = torch.empty_like(shrunk)  # G: every column is written below
    out, start = [], 0
    for j, (grad, (_, bias, lora_a, lora_b), scale) in enumerate(zip(grads, groups, spec.scales, strict=True)):
        columns = slice(start, start + lora_a.shape[0])
        scaled_mm(grad, lora_b, scale, out=scaled[:, columns])  # s dY B
        grad_b = scaled_mm(grad.t(), shrunk[:, columns], scale) if need[4 * j + 3] else None  # s dY^T shrunk
        grad_bias = grad.sum(0) if bias is not None and need[4 * j + 1] else None
        out.append([None, grad_bias, columns, grad_b])
        start = columns.stop
    grad_stacked = scaled.t() @ x if any(need[4 * j + 2] for j in range(3)) else None  # [R, hidden]: one GEMM
    for j, entry in enumerate(out):
        entry[2] = grad_stacked[entry[2]] if need[4 * j + 2] else None
    return scaled, [t for entry in out for t in entry]
