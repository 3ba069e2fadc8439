"""Rotary position embedding of queries and keys, in the [batch, tokens, heads, head_dim] layout of a projection's
output viewed per head.

`rope_reference` is the model's own formula (transformers' `apply_rotary_pos_emb`, rotate-half layout, with cos
and sin unsqueezed over the heads); `rope` runs the Triton kernels (`ops.kernels.rope`, one launch for q and k each
way, eager's roundings) where they run and the reference elsewhere.
"""

from __future__ import annotations

import torch

from slimrl.ops import kernels


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated: x cos + rotate_half(x) sin, cos and sin [batch or 1, tokens, head_dim] broadcast over heads."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_backward_reference(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(d q, d k) of `rope_reference` from its outputs' gradients, rounded as autograd rounds them: each path's
    product (g cos; g sin through rotate_half's transpose, [y2, -y1]), then their sum."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)

    def back(g):
        half = g.shape[-1] // 2
        turned = g * sin
        return g * cos + torch.cat((turned[..., half:], -turned[..., :half]), dim=-1)

    return back(grad_q), back(grad_k)


def kernel_takes(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rope` runs the kernels on these: Triton runs here, one dtype throughout (a promoting product is left
    to eager), an even head_dim, and cos / sin of [batch or 1, tokens, head_dim] that need no gradient."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.requires_grad:
        return False
    batch, tokens, _, dim = q.shape
    shapes_match = k.shape[0:2] == (batch, tokens) and k.shape[3] == dim and cos.shape[1:] == (tokens, dim)
    return (shapes_match and cos.shape[0] in (1, batch) and dim % 2 == 0 and kernels.runs_here(q)
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.device == cos.device)  # fmt: skip


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k) rotated, through the kernels where `kernel_takes` says so, else the reference."""
    if not kernel_takes(q, k, cos, sin):
        return rope_reference(q, k, cos, sin)
    from slimrl.ops.kernels.rope import rope as rope_kernel

    return rope_kernel(q, k, cos, sin)
