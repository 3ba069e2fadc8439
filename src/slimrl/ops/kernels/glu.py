"""The gated MLP's element-wise product h = act(g) * u (act: SiLU, or GELU with the tanh approximation as Gemma uses),
forward, and backward in one pass that overwrites its inputs.

The backward reads dh, g and u once and writes h (which the down projection's LoRA-A gradient needs), dg and du into
the same three buffers: no [tokens, intermediate] tensor is allocated, so the MLP's backward stays at the three
buffers it already holds, and h need not be saved from the forward (it is recomputed from g and u, which are read
anyway). Roundings follow eager PyTorch: act(g) rounded to the dtype, then the product; in the backward dh * u rounded
before act's derivative (computed in fp32, as PyTorch's silu/gelu backward do), dh * act(g) rounded.
References: `slimrl.ops.lora_mlp.glu_reference` / `glu_backward_reference`. Import only where Triton may be used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimrl.ops.kernels.rounding import round_to

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
BLOCK = 1024  # elements per program: a flat, memory-bound pass
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(-g))
        value = g / (1.0 + tl.exp(-g))  # PyTorch's form of silu, for the same rounding
        slope = sig * (1.0 + g * (1.0 - sig))
    else:
        # GELU-tanh in PyTorch's own form, for the same rounding; tanh(z) = 2 sig(2z) - 1 (tl has no tanh that the
        # interpreter and every GPU backend share)
        # below z = -40, t is -1 in fp32 anyway; the bound keeps exp from overflowing
        z = tl.maximum(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g), -40.0)
        t = 2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0
        value = 0.5 * g * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    return value, slope


@triton.jit
def _glu_forward_kernel(g_ptr, u_ptr, h_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    DT = h_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    act, _ = _activation(g, ACT)
    h = round_to(round_to(act, DT) * u, DT)
    tl.store(h_ptr + offs, h.to(DT), mask=ok)


@triton.jit
def _glu_backward_kernel(dh_ptr, g_ptr, u_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """dh -> h, g -> dg, u -> du, each over its own buffer."""
    DT = dh_ptr.dtype.element_ty
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dh = tl.load(dh_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    act, slope = _activation(g, ACT)
    act = round_to(act, DT)
    h = round_to(act * u, DT)
    du = round_to(dh * act, DT)
    dg = round_to(round_to(dh * u, DT) * slope, DT)
    tl.store(dh_ptr + offs, h.to(DT), mask=ok)
    tl.store(g_ptr + offs, dg.to(DT), mask=ok)
    tl.store(u_ptr + offs, du.to(DT), mask=ok)


def _check(activation: str, *tensors: torch.Tensor) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise ValueError("the gated product's tensors must be contiguous, of one shape and dtype; got "
                             f"{[(tuple(x.shape), x.dtype, x.is_contiguous()) for x in tensors]}")  # fmt: skip


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up in one pass; gate and up contiguous, of one shape and dtype."""
    _check(activation, gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    _glu_forward_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, ACT=ACTIVATIONS[activation], BLOCK=BLOCK)
    return out


def glu_backward_(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> None:
    """In place: grad_h becomes h = act(gate) * up, gate becomes d loss / d gate, up becomes d loss / d up."""
    _check(activation, grad_h, gate, up)
    n = gate.numel()
    _glu_backward_kernel[(triton.cdiv(n, BLOCK),)](grad_h, gate, up, n, ACT=ACTIVATIONS[activation], BLOCK=BLOCK)
    for t in (grad_h, gate, up):  # the kernel writes through pointers: tell autograd these tensors changed
        torch.autograd.graph.increment_version(t)
