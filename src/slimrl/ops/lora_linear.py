"""A LoRA projection y = x W^T + b + s (x A^T) B^T as one autograd Function with a hand-derived backward.

peft computes it as a base GEMM, two LoRA GEMMs, then a scale and an add over [tokens, out] (and their mirror in the
backward), and autograd saves x for each GEMM and x A^T for the last. Here the LoRA expand is added inside its GEMM
(`addmm_` into the base output with alpha = s), and the backward is written out:

    dB = s (dY)^T (x A^T)        [out, r]
    dA = s (dY B)^T x            [r, in]
    dX = dY W + s (dY B) A       [tokens, in]   (the second term added inside its GEMM into the first's buffer)

(each scale the alpha of its GEMM: `scaled_mm`).

Only x and x A^T ([tokens, r]) are saved besides the weights. W stays frozen (no dW). A 4-bit base is passed as its
packed weight with a `dequantize` callable: the full-precision W exists only inside the forward and again inside
the backward, never between them.

All GEMMs run in one compute dtype: the autocast dtype when autocast is on for x's device, else x's dtype. The casts
of A and B (fp32 adapters on a bf16 base) happen outside the Function, so autograd hands their gradients back in
the adapters' dtype. `lora_linear_reference` is peft's formula in plain PyTorch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

_PASSES: list[dict] = []  # the open `one_layer_pass` blocks, innermost last


class LoRAProjection(NamedTuple):
    """One LoRA-adapted Linear: the frozen base (weight [out, in] or a packed weight with `dequantize`, bias [out] or
    None) and the adapter (lora_a [r, in], lora_b [out, r], scale = alpha / r)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float
    dequantize: Callable[[torch.Tensor], torch.Tensor] | None = None


def base_weight(projection: LoRAProjection, dtype: torch.dtype) -> torch.Tensor:
    """The base weight [out, in] in `dtype`, dequantised when the projection holds a packed one."""
    weight = projection.weight if projection.dequantize is None else projection.dequantize(projection.weight)
    return weight.to(dtype)


def lora_linear_reference(x: torch.Tensor, projection: LoRAProjection) -> torch.Tensor:
    """peft's LoRA Linear (no dropout): base(x) + lora_B(lora_A(x)) * scaling."""
    weight = base_weight(projection, x.dtype)
    bias = None if projection.bias is None else projection.bias.to(x.dtype)
    base = torch.nn.functional.linear(x, weight, bias)
    lora = (x @ projection.lora_a.to(x.dtype).t()) @ projection.lora_b.to(x.dtype).t()
    return base + lora * projection.scale


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused GEMMs run in: autocast's when it is on for x's device, else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


@contextlib.contextmanager
def one_layer_pass() -> Iterator[None]:
    """A block in which the LoRA weights do not change: each adapter weight is cast to a compute dtype once and the
    cast reused by every fused call in it (a decoder layer's MLP recomputed in tiles calls the fused MLP once per
    tile), and `remembered` values are kept. The offloaded checkpoints open one per layer pass; nothing outlives it."""
    _PASSES.append({})
    try:
        yield
    finally:
        _PASSES.pop()


def remembered(key, make: Callable):
    """`make()`, once per `one_layer_pass` block for this key (every call outside one)."""
    if not _PASSES:
        return make()
    found = _PASSES[-1].get(key)
    if found is None:
        found = _PASSES[-1][key] = make()
    return found


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """tensor.to(dtype), made once per `one_layer_pass` block, version of the tensor and grad mode. The cast made
    under grad is one autograd node shared by every use: it saves no tensor, so each use's backward runs through it
    and accumulates into the weight as separate casts would."""
    if tensor.dtype == dtype or not _PASSES:
        return tensor.to(dtype)
    # the entry keeps the tensor itself, so no other tensor can take its id while the block is open
    key = ("cast", id(tensor), tensor._version, dtype, torch.is_grad_enabled())
    return remembered(key, lambda: (tensor, tensor.to(dtype)))[1]


def check_frozen(projection: LoRAProjection, name: str = "projection") -> None:
    """The fused ops compute no base-weight gradient: a trainable base weight is an error, not a silent zero."""
    if projection.weight.requires_grad:
        raise ValueError(f"{name}: the fused LoRA ops keep the base weight frozen, but it requires grad; freeze it "
                         "(weight.requires_grad_(False)) or use peft's forward (disable_fast_lora).")


def full_weight(weight: torch.Tensor, dequantize: Callable | None, dtype: torch.dtype) -> torch.Tensor:
    """A Function's base weight as its GEMMs take it: as given, or dequantised to `dtype` from a packed one."""
    return weight if dequantize is None else dequantize(weight).to(dtype)


def project(x, weight, bias, shrunk, lora_b, scale: float) -> torch.Tensor:
    """x W^T + b + s shrunk B^T, the LoRA expand accumulated into the base GEMM's output."""
    out = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
    return out.addmm_(shrunk, lora_b.t(), alpha=scale)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """scale * (a @ b) as one GEMM, the scale its alpha (applied before the result's one rounding, no separate
    multiplication), written into `out` (a column slice of a wider buffer will do) or a new tensor."""
    if out is None:
        out = a.new_empty(a.shape[0], b.shape[1])
    return out.addmm_(a, b, beta=0, alpha=scale)  # beta 0: out's old contents are never read


def function_inputs(projection: LoRAProjection, dtype: torch.dtype) -> list:
    """[weight, bias or None, lora_a, lora_b] as the fused Functions take them: in `dtype` (a packed weight as it is;
    the adapters through the per-pass `cast`)."""
    weight = projection.weight if projection.dequantize is not None else projection.weight.to(dtype)
    bias = None if projection.bias is None else projection.bias.to(dtype)
    return [weight, bias, cast(projection.lora_a, dtype), cast(projection.lora_b, dtype)]


def lora_linear(x: torch.Tensor, projection: LoRAProjection) -> torch.Tensor:
    """The fused LoRA projection of x [..., in] -> [..., out] in the compute dtype (see `compute_dtype`)."""
    check_frozen(projection)
    dtype = compute_dtype(x)
    weight, bias, lora_a, lora_b = function_inputs(projection, dtype)
    with torch.autocast(x.device.type, enabled=False):
        out = LoRALinearFunction.apply(x.to(dtype).reshape(-1, x.shape[-1]), weight, bias, lora_a, lora_b,
                                       float(projection.scale), projection.dequantize)  # fmt: skip
    return out.view(*x.shape[:-1], out.shape[-1])


class LoRALinearFunction(torch.autograd.Function):
    """x [tokens, in] -> [tokens, out]; every floating tensor in one dtype (the weight may be a packed one that
    `dequantize` expands to it). Saves x and x A^T."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale: float, dequantize):
        shrunk = x @ lora_a.t()  # [tokens, r]
        out = project(x, full_weight(weight, dequantize, x.dtype), bias, shrunk, lora_b, scale)
        ctx.save_for_backward(x, shrunk, weight, lora_a, lora_b)
        ctx.scale, ctx.dequantize, ctx.has_bias = scale, dequantize, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, shrunk, weight, lora_a, lora_b = ctx.saved_tensors
        scale = ctx.scale
        with torch.autocast(grad_out.device.type, enabled=False):  # a recompute's backward may run under autocast
            grad_out = grad_out.to(x.dtype)
            grad_b = scaled_mm(grad_out.t(), shrunk, scale) if ctx.needs_input_grad[4] else None
            grad_shrunk = grad_out @ lora_b  # d loss / d (x A^T), unscaled: [tokens, r]
            grad_a = scaled_mm(grad_shrunk.t(), x, scale) if ctx.needs_input_grad[3] else None
            grad_x = None
            if ctx.needs_input_grad[0]:
                full = full_weight(weight, ctx.dequantize, x.dtype)
                grad_x = grad_out @ full
                del full  # a dequantised base goes before the next GEMM's output is made
                grad_x.addmm_(grad_shrunk, lora_a, alpha=scale)
            grad_bias = grad_out.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, grad_a, grad_b, None, None
