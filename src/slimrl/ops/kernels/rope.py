"""Rotary position embedding of the training forward (queries and keys in one launch) and its backward, as an
autograd Function. Import only where Triton may be used.

The model's formula (Llama, Qwen2/3, Mistral: `apply_rotary_pos_emb` with the "rotate half" layout) is, per head
row x = [x1, x2] and the position's cos = [c1, c2], sin = [s1, s2]:

    out = [x1 c1 - x2 s1,  x2 c2 + x1 s2]
    d x = [g1 c1 + g2 s2,  g2 c2 - g1 s1]          (g = d out: the rotation by minus the angle)

Eager PyTorch computes it as five kernels per tensor (two products, a negation, a concatenation, a sum; each
rounded to the dtype) and autograd's backward as about as many. Here each of the two runs once for q and k
together, rounding where eager rounds (each product, then the sum), so the result has eager's bits in bf16, fp16
and fp32. The backward's input gradient is rounded as autograd rounds it: each path's product, then their sum.

q and k come in the [batch, tokens, heads, head_dim] layout (the projection's output viewed per head; any strides
with a contiguous last dimension), cos and sin as the rotary embedding gives them, [batch or 1, tokens, head_dim],
in q's dtype. Outputs are new contiguous tensors of q's and k's shapes; `rotate_` writes the forward's over
contiguous q and k instead (the fused q/k/v projection of `ops.lora_qkv` rotates its own outputs in place).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slimrl.ops.kernels.rounding import round_bf16_bits, round_to

ROWS_PER_PROGRAM = 4  # token rows per program: each row is all heads of one token (a few KB)
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _kept(product, X: tl.constexpr):
    """A product rounded to X as eager rounds it, in a form the compiler keeps: on the GPU the fp32 product is
    formed with `mul.rn` (never contracted into an FMA with the sum it feeds, which fp32 would otherwise get) and a
    bf16 rounding is done on the bits (a cast pair to bf16 and back was seen optimised away: 25% of the outputs were
    one ulp off eager's)."""
    if X == tl.bfloat16:
        return round_bf16_bits(product)
    return round_to(product, X)


@triton.jit
def _mul(a, b):
    if _INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)  # fmt: skip


@triton.jit
def _rotate_rows(x_ptr, out_ptr, cos_ptr, sin_ptr, first, rows, tokens, heads, sxb, sxt, sxh, scb, sct,
                 HALF, HEADS_P: tl.constexpr, HALF_P: tl.constexpr, ROWS: tl.constexpr,
                 BACKWARD: tl.constexpr):  # fmt: skip
    """Rows [first, first + ROWS) of one tensor: every head of each token rotated (BACKWARD: by minus the angle)."""
    X = out_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HALF_P)[None, :]
    ok = (h < heads) & (d < HALF)
    for i in tl.static_range(ROWS):
        row = first + i
        live = (d * 0 + row) < rows  # [1, HALF_P]: the interpreter takes no scalar mask
        b, t = row // tokens, row % tokens
        at = b * sxb + t * sxt + h * sxh + d
        x1 = tl.load(x_ptr + at, mask=ok & live, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + at + HALF, mask=ok & live, other=0.0).to(tl.float32)
        trig = b * scb + t * sct + d
        c1 = tl.load(cos_ptr + trig, mask=(d < HALF) & live, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + trig + HALF, mask=(d < HALF) & live, other=0.0).to(tl.float32)
        if BACKWARD:  # the first half takes the second's sine, with a plus; the second the first's, with a minus
            s_first = tl.load(sin_ptr + trig + HALF, mask=(d < HALF) & live, other=0.0).to(tl.float32)
            s_second = -tl.load(sin_ptr + trig, mask=(d < HALF) & live, other=0.0).to(tl.float32)
        else:
            s_first = -tl.load(sin_ptr + trig, mask=(d < HALF) & live, other=0.0).to(tl.float32)
            s_second = tl.load(sin_ptr + trig + HALF, mask=(d < HALF) & live, other=0.0).to(tl.float32)
        out1 = _kept(_kept(_mul(x1, c1), X) + _kept(_mul(x2, s_first), X), X)
        out2 = _kept(_kept(_mul(x2, c2), X) + _kept(_mul(x1, s_second), X), X)
        dst = row.to(tl.int64) * heads * (2 * HALF) + h * (2 * HALF) + d
        tl.store(out_ptr + dst, out1.to(X), mask=ok & live)
        tl.store(out_ptr + dst + HALF, out2.to(X), mask=ok & live)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out, k_out, cos_ptr, sin_ptr, rows, tokens, q_heads, k_heads,
                 sqb, sqt, sqh, skb, skt, skh, scb, sct, HALF, Q_HEADS_P: tl.constexpr, K_HEADS_P: tl.constexpr,
                 HALF_P: tl.constexpr, ROWS: tl.constexpr, BACKWARD: tl.constexpr):  # fmt: skip
    """Axis 0: blocks of ROWS token rows; axis 1: 0 rotates q, 1 rotates k."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    if tl.program_id(1) == 0:
        _rotate_rows(q_ptr, q_out, cos_ptr, sin_ptr, first, rows, tokens, q_heads, sqb, sqt, sqh, scb, sct, HALF,
                     Q_HEADS_P, HALF_P, ROWS, BACKWARD)  # fmt: skip
    else:
        _rotate_rows(k_ptr, k_out, cos_ptr, sin_ptr, first, rows, tokens, k_heads, skb, skt, skh, scb, sct, HALF,
                     K_HEADS_P, HALF_P, ROWS, BACKWARD)  # fmt: skip


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool,
            in_place: bool = False):  # fmt: skip
    """(q rotated, k rotated) as new contiguous tensors, or with `in_place` written over q and k themselves (both
    contiguous: each program reads a row's two halves before it writes them); one launch."""
    if in_place:
        if not (q.is_contiguous() and k.is_contiguous()):
            raise ValueError("an in-place rotation needs contiguous q and k")
        q_out, k_out = q, k
    else:
        q, k = _last_contiguous(q), _last_contiguous(k)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    batch, tokens, q_heads, dim = q.shape
    k_heads = k.shape[2]
    rows = batch * tokens
    if rows == 0:
        return q_out, k_out
    cos_b = 0 if cos.shape[0] == 1 else cos.stride(0)
    half = dim // 2
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), 2)
    _rope_kernel[grid](q, k, q_out, k_out, cos, sin, rows, tokens, q_heads, k_heads, q.stride(0), q.stride(1),
                       q.stride(2), k.stride(0), k.stride(1), k.stride(2), cos_b, cos.stride(1), half,
                       Q_HEADS_P=triton.next_power_of_2(q_heads), K_HEADS_P=triton.next_power_of_2(k_heads),
                       HALF_P=triton.next_power_of_2(half), ROWS=ROWS_PER_PROGRAM, BACKWARD=backward,
                       num_warps=4)  # fmt: skip
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    """(q, k) [batch, tokens, heads, head_dim] -> (q, k) rotated; saves cos and sin only."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.shapes, ctx.dtypes = (q.shape, k.shape), (q.dtype, k.dtype)
        return _rotate(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        grads = zip((grad_q, grad_k), ctx.shapes, ctx.dtypes, strict=True)
        grad_q, grad_k = (torch.zeros(shape, dtype=dtype, device=cos.device) if grad is None else grad
                          for grad, shape, dtype in grads)  # fmt: skip
        dq, dk = _rotate(grad_q, grad_k, cos, sin, backward=True)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`slimrl.ops.rope.rope_reference` through the kernels; same arguments and layout."""
    return RoPEFunction.apply(q, k, cos, sin)


def rotate_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate contiguous q and k in place (no autograd; `ops.lora_qkv` calls it on its own fresh outputs)."""
    _rotate(q, k, cos.contiguous(), sin.contiguous(), backward=False, in_place=True)


def unrotate(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The rotation's backward: (d q, d k) from the rotated outputs' gradients, as new contiguous tensors."""
    return _rotate(grad_q, grad_k, cos.contiguous(), sin.contiguous(), backward=True)
