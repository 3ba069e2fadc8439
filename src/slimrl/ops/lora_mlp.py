"""The gated MLP down(act(gate(x)) * up(x)) with LoRA on gate, up and down, as one autograd Function with a
hand-derived backward.

Forward, per call ([tokens, hidden] in, N = tokens, I = intermediate, r = ranks):
    shrunk = x [A_gate; A_up]^T                 [N, r_g + r_u]  the two LoRA shrinks of x in ONE GEMM
    gate   = x W_g^T + b_g + s_g shrunk_g B_g^T  [N, I]          the LoRA term added inside its GEMM (addmm_)
    up     = the same with W_u, B_u, s_u         [N, I]
    h      = act(gate) * up                      [N, I]          one Triton pass (ops/kernels/glu.py)
    out    = h W_d^T + b_d + s_d (h A_d^T) B_d^T [N, hidden]
Saved: x, gate, up, shrunk, h A_d^T and [A_gate; A_up] (small). h is NOT saved: the backward's element-wise kernel
reads gate and up anyway and recomputes h in the same pass, so the Function keeps 2 [N, I] tensors where peft's
chain keeps 4 (gate, act(gate), up, h). The backward then writes h, d gate and d up over the buffers of d h, gate and
up (in place), so it allocates no further [N, I] tensor either: its peak is the three it holds.

Backward (dY [N, hidden]):
    dB_d = s_d dY^T (h A_d^T);  dH = dY W_d + s_d (dY B_d) A_d;  (h, dG, dU) = glu_backward(dH, gate, up)
    dA_d = s_d (dY B_d)^T h;    dB_g = s_g dG^T shrunk_g;  dB_u = s_u dU^T shrunk_u
    dX   = dG W_g + dU W_u + [s_g dG B_g, s_u dU B_u] [A_gate; A_up]  (three GEMMs into one buffer)
    [dA_gate; dA_up] = [s_g dG B_g, s_u dU B_u]^T x   (one GEMM)
Every scale is the alpha of its GEMM (`lora_linear.scaled_mm`): no separate multiplications.

Inside `output_unread()` (a recompute whose output only carries a gradient back: models/recompute.py) the forward
stops after gate and up and returns an uninitialised [N, hidden] tensor: the backward needs the output's gradient,
never its value, and its element-wise kernel makes h anyway, from which it then takes h A_d^T. The gradients are the
same bits, and a recompute skips down's GEMM (29% of a Qwen2.5-1.5B MLP's FLOPs) and the gated product's forward.
Base weights stay frozen; a 4-bit base is dequantised in the forward and again in the backward, one projection at a
time. Dtypes as in `slimrl.ops.lora_linear` (one compute dtype; autocast's when on). The in-place backward means a
second backward through the same graph (retain_graph) fails loudly in autograd's version check; `in_place=False`
copies gate and up first (what gradcheck needs). Off CUDA (and outside Triton's interpreter) the element-wise steps
run in PyTorch with the same roundings.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

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

ACTIVATIONS = ("silu", "gelu_tanh")  # SiLU: Llama, Qwen2/3, Mistral; GELU-tanh: Gemma's gelu_pytorch_tanh
_OUTPUT_UNREAD = contextvars.ContextVar("slimrl_lora_mlp_output_unread", default=False)


@contextlib.contextmanager
def output_unread():
    """Within: `lora_mlp` leaves its output's values uncomputed (uninitialised memory of the right shape). Only for
    a call whose output is handed to autograd as the root of a backward with a given gradient and read by nothing
    else: the recompute of a checkpointed layer's MLP."""
    token = _OUTPUT_UNREAD.set(True)
    try:
        yield
    finally:
        _OUTPUT_UNREAD.reset(token)


def glu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up as the model computes it (LlamaMLP's act_fn, then the product)."""
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def _activation_and_slope(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)); act(g) by PyTorch's own function, so that h here has `glu_reference`'s bits."""
    if activation == "silu":
        sig = torch.sigmoid(g)
        return F.silu(g), sig * (1 + g * (1 - sig))
    k = math.sqrt(2 / math.pi)
    t = torch.tanh(k * (g + 0.044715 * g**3))
    return F.gelu(g, approximate="tanh"), 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)


def glu_backward_reference(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"):
    """(h, d gate, d up) by hand, rounded where the kernel (and eager autograd) round: act(gate), the product, and
    grad_h * up before the activation's slope, computed in fp32 (fp64 for fp64 inputs)."""
    dtype = gate.dtype
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    g, u, dh = gate.to(wide), up.to(wide), grad_h.to(wide)
    value, slope = _activation_and_slope(g, activation)
    value = value.to(dtype).to(wide)
    h = (value * u).to(dtype)
    grad_up = (dh * value).to(dtype)
    grad_gate = ((dh * u).to(dtype).to(wide) * slope).to(dtype)
    return h, grad_gate, grad_up


def lora_mlp_reference(x: torch.Tensor, gate: LoRAProjection, up: LoRAProjection, down: LoRAProjection,
                       activation: str = "silu") -> torch.Tensor:  # fmt: skip
    """peft's three LoRA Linears around the model's gated product, in plain PyTorch."""
    product = glu_reference(lora_linear_reference(x, gate), lora_linear_reference(x, up), activation)
    return lora_linear_reference(product, down)


class _Spec(NamedTuple):
    """The Function's non-tensor arguments: per projection (gate, up, down) its scale and dequantize callable."""

    scales: tuple[float, float, float]
    dequantize: tuple[Callable | None, Callable | None, Callable | None]
    activation: str
    in_place: bool
    output_read: bool = True  # False: the forward stops after gate and up (see `output_unread`)


def lora_mlp(x: torch.Tensor, gate: LoRAProjection, up: LoRAProjection, down: LoRAProjection,
             activation: str = "silu", in_place: bool = True) -> torch.Tensor:  # fmt: skip
    """The fused LoRA MLP of x [..., hidden] -> [..., hidden], in the compute dtype (see `lora_linear.compute_dtype`).
    `in_place=False` keeps the saved gate and up intact through the backward (a second backward can then run)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, projection in (("gate", gate), ("up", up), ("down", down)):
        check_frozen(projection, name)
    dtype = compute_dtype(x)
    tensors = [t for p in (gate, up, down) for t in function_inputs(p, dtype)]
    spec = _Spec((float(gate.scale), float(up.scale), float(down.scale)),
                 (gate.dequantize, up.dequantize, down.dequantize), activation, in_place,
                 not _OUTPUT_UNREAD.get())  # fmt: skip
    with torch.autocast(x.device.type, enabled=False):
        out = LoRAMLPFunction.apply(x.to(dtype).reshape(-1, x.shape[-1]), spec, *tensors)
    return out.view(*x.shape[:-1], out.shape[-1])


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if kernels.runs_here(gate):
        from slimrl.ops.kernels.glu import glu_forward

        return glu_forward(gate, up, activation)
    return glu_reference(gate, up, activation)


def _glu_backward(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str):
    """(h, d gate, d up); with the kernel these are grad_h's, gate's and up's own buffers, overwritten."""
    if kernels.runs_here(gate):
        from slimrl.ops.kernels.glu import glu_backward_

        glu_backward_(grad_h, gate, up, activation)
        return grad_h, gate, up
    return glu_backward_reference(grad_h, gate, up, activation)


class LoRAMLPFunction(torch.autograd.Function):
    """x [tokens, hidden] -> [tokens, hidden]. Tensors after `spec`: per projection (gate, up, down) weight, bias
    (or None), lora_a, lora_b, all in x's dtype but a packed weight. Saves x, gate, up and the two shrinks (down's only
    when the output was computed)."""

    @staticmethod
    def forward(ctx, x, spec: _Spec, *tensors):
        (w_g, bias_g, a_g, b_g), (w_u, bias_u, a_u, b_u), (w_d, bias_d, a_d, b_d) = (tensors[i : i + 4]
                                                                                      for i in (0, 4, 8))  # fmt: skip
        (s_g, s_u, s_d), (deq_g, deq_u, deq_d) = spec.scales, spec.dequantize
        rank_g = a_g.shape[0]
        stacked = torch.cat([a_g, a_u])  # [r_g + r_u, hidden], small; the backward's dX takes it too
        shrunk = x @ stacked.t()  # [N, r_g + r_u]
        gate = project(x, full_weight(w_g, deq_g, x.dtype), bias_g, shrunk[:, :rank_g], b_g, s_g)  # [N, I]
        up = project(x, full_weight(w_u, deq_u, x.dtype), bias_u, shrunk[:, rank_g:], b_u, s_u)  # [N, I]
        if spec.output_read:
            h = _glu(gate, up, spec.activation)  # [N, I], freed when the forward returns
            down_shrunk = h @ a_d.t()  # [N, r_d]
            out = project(h, full_weight(w_d, deq_d, x.dtype), bias_d, down_shrunk, b_d, s_d)
        else:  # only the output's gradient will be used (`output_unread`): its shape, no values; h A_d^T is taken
            # in the backward from the h its element-wise kernel makes anyway (the same bits as the forward's)
            out, down_shrunk = x.new_empty(x.shape[0], b_d.shape[0]), None
        ctx.spec = spec
        ctx.save_for_backward(x, gate, up, shrunk, down_shrunk, stacked, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, gate, up, shrunk, down_shrunk, stacked, *tensors = ctx.saved_tensors
        spec, need = ctx.spec, ctx.needs_input_grad[2:]  # need: per tensor after spec, as in `tensors`
        with torch.autocast(grad_out.device.type, enabled=False):  # a recompute's backward may run under autocast
            grad_out = grad_out.to(x.dtype)
            if not spec.in_place:
                gate, up = gate.clone(), up.clone()
            grad_h, grad_down_shrunk, grads_down = _down_backward(grad_out, down_shrunk, tensors[8:], spec, need[8:])
            h, grad_gate, grad_up = _glu_backward(grad_h, gate, up, spec.activation)
            del grad_h, gate, up  # with the kernel their buffers now hold h, d gate and d up
            if down_shrunk is None and need[11]:  # an unread forward: dB_d = s_d dY^T (h A_d^T) now
                grads_down[3] = scaled_mm(grad_out.t(), h @ tensors[10].t(), spec.scales[2])
            if need[10]:  # dA_d = s_d (dY B_d)^T h
                grads_down[2] = scaled_mm(grad_down_shrunk.t(), h, spec.scales[2])
            del h
            grad_x, grads_gate_up = _gate_up_backward(x, grad_gate, grad_up, shrunk, stacked, tensors[:8], spec,
                                                      ctx.needs_input_grad[0], need[:8])  # fmt: skip
        return (grad_x, None, *grads_gate_up, *grads_down)


def _down_backward(grad_out, down_shrunk, down_tensors, spec: _Spec, need):
    """(dH [N, I], dY B_d [N, r_d] (unscaled), [None, d bias_d, None (dA_d needs h), dB_d]); dB_d is None when the
    forward kept no h A_d^T (an unread output: the caller takes it once h is made)."""
    w_d, bias_d, a_d, b_d = down_tensors
    s_d = spec.scales[2]
    grad_down_shrunk = grad_out @ b_d
    grad_b = scaled_mm(grad_out.t(), down_shrunk, s_d) if need[3] and down_shrunk is not None else None
    grad_bias = grad_out.sum(0) if bias_d is not None and need[1] else None
    grad_h = grad_out @ full_weight(w_d, spec.dequantize[2], grad_out.dtype)
    grad_h.addmm_(grad_down_shrunk, a_d, alpha=s_d)
    return grad_h, grad_down_shrunk, [None, grad_bias, None, grad_b]


def _gate_up_backward(x, grad_gate, grad_up, shrunk, stacked, tensors, spec: _Spec, need_x: bool, need):
    """(dX, [None, d bias_g, dA_g, dB_g, None, d bias_u, dA_u, dB_u]); `need` as the Function's, for these;
    `stacked` is [A_gate; A_up]."""
    w_g, bias_g, a_g, b_g, w_u, bias_u, a_u, b_u = tensors
    (s_g, s_u, _), (deq_g, deq_u, _) = spec.scales, spec.dequantize
    rank_g = a_g.shape[0]
    grad_b_g = scaled_mm(grad_gate.t(), shrunk[:, :rank_g], s_g) if need[3] else None
    grad_b_u = scaled_mm(grad_up.t(), shrunk[:, rank_g:], s_u) if need[7] else None
    # d loss / d shrunk, scaled: [s_g dG B_g, s_u dU B_u], two GEMMs into the column slices of one [N, r_g + r_u]
    grad_shrunk = torch.empty_like(shrunk)
    scaled_mm(grad_gate, b_g, s_g, out=grad_shrunk[:, :rank_g])
    scaled_mm(grad_up, b_u, s_u, out=grad_shrunk[:, rank_g:])
    grad_a = torch.mm(grad_shrunk.t(), x) if need[2] or need[6] else None  # [r_g + r_u, hidden]: one GEMM
    grad_bias_g = grad_gate.sum(0) if bias_g is not None and need[1] else None
    grad_bias_u = grad_up.sum(0) if bias_u is not None and need[5] else None
    grad_x = None
    if need_x:  # dG W_g + dU W_u + grad_shrunk [A_gate; A_up], accumulated in one buffer
        grad_x = grad_gate @ full_weight(w_g, deq_g, x.dtype)
        grad_x.addmm_(grad_up, full_weight(w_u, deq_u, x.dtype))
        grad_x.addmm_(grad_shrunk, stacked)
    grad_a_g = grad_a[:rank_g] if need[2] else None
    grad_a_u = grad_a[rank_g:] if need[6] else None
    return grad_x, [None, grad_bias_g, grad_a_g, grad_b_g, None, grad_bias_u, grad_a_u, grad_b_u]
