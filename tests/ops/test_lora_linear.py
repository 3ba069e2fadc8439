"""The fused LoRA projection (`ops.lora_linear`) against peft's formula in plain PyTorch: output and the gradient of
the input, the bias and both LoRA matrices at odd shapes in fp32 and bf16; gradcheck in fp64; what it saves; the
dequantize hook of a 4-bit base; dtypes under autocast; and, on a GPU, W1's shapes."""

from __future__ import annotations

import pytest
import torch

from slimrl.ops.lora_linear import LoRALinearFunction, LoRAProjection, lora_linear, lora_linear_reference, scaled_mm
from tests.tolerances import assert_close

# (tokens, in, out, rank, bias): tokens 1, 7, 33; widths 48 / 96 / 136; ranks 4 and 8; with and without bias
CASES = [(1, 48, 136, 4, True), (7, 96, 48, 8, False), (33, 48, 96, 8, True), (33, 136, 48, 4, False)]
KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def make_projection(g, in_features, out_features, rank, bias, dtype, scale=2.0, adapter_dtype=None):
    """A frozen base and a LoRA pair whose term is of the base's order (B not zero, as after some training)."""
    adapter_dtype = adapter_dtype or dtype
    weight = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(dtype)
    b = (torch.randn(out_features, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    lora_a = (torch.randn(rank, in_features, generator=g) * in_features**-0.5).to(adapter_dtype).requires_grad_()
    lora_b = (torch.randn(out_features, rank, generator=g) * 0.3).to(adapter_dtype).requires_grad_()
    return LoRAProjection(weight, b, lora_a, lora_b, scale)


def leaves(projection: LoRAProjection) -> list[torch.Tensor]:
    return [t for t in (projection.bias, projection.lora_a, projection.lora_b) if t is not None]


def fresh(projection: LoRAProjection) -> LoRAProjection:
    """The same values as new leaves (each side of a comparison gets its own gradients)."""
    def copy(t):
        return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)

    return projection._replace(bias=copy(projection.bias), lora_a=copy(projection.lora_a),
                               lora_b=copy(projection.lora_b))  # fmt: skip


def run(function, x, upstream, *modules):
    """Output, and the gradients of x and of every trainable tensor of `modules`, for one backward of `upstream`."""
    x = x.detach().clone().requires_grad_()
    out = function(x)
    params = [t for m in modules for t in leaves(m)]
    grads = torch.autograd.grad(out, [x, *params], upstream)
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, in_features, out_features, rank, bias", CASES)
def test_forward_and_every_gradient_match_peft_formula(tokens, in_features, out_features, rank, bias, dtype):
    g = torch.Generator().manual_seed(tokens * 100 + rank)
    projection = make_projection(g, in_features, out_features, rank, bias, dtype)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    upstream = torch.randn(tokens, out_features, generator=g).to(dtype)
    fused, reference = fresh(projection), fresh(projection)
    got, got_grads = run(lambda t: lora_linear(t, fused), x, upstream, fused)
    want, want_grads = run(lambda t: lora_linear_reference(t, reference), x, upstream, reference)
    kind = KINDS[dtype]
    assert got.dtype == dtype
    assert_close(got, want, kind, name="output")
    names = ["x"] + (["bias"] if bias else []) + ["lora_a", "lora_b"]
    for name, a, b in zip(names, got_grads, want_grads, strict=True):
        # bias and B gradients are sums over the tokens: in bf16 they collect one rounding per token
        assert_close(a, b, "bf16_sum" if kind == "bf16" and name != "x" else kind, name=f"grad of {name}")


def test_a_batched_input_keeps_its_leading_dimensions():
    g = torch.Generator().manual_seed(1)
    projection = make_projection(g, 48, 96, 4, True, torch.float32)
    x = torch.randn(2, 5, 48, generator=g)
    out = lora_linear(x, projection)
    assert out.shape == (2, 5, 96)
    assert_close(out, lora_linear_reference(x, projection), name="batched output")


def test_gradcheck_in_float64():
    g = torch.Generator().manual_seed(2)
    projection = make_projection(g, 9, 7, 3, True, torch.float64)
    x = torch.randn(5, 9, generator=g, dtype=torch.float64, requires_grad=True)

    def function(x, bias, lora_a, lora_b):
        return LoRALinearFunction.apply(x, projection.weight, bias, lora_a, lora_b, 0.7, None)

    assert torch.autograd.gradcheck(function, (x, *leaves(projection)))


def test_saves_only_x_and_its_lora_shrink_besides_the_weights():
    g = torch.Generator().manual_seed(3)
    projection = make_projection(g, 48, 96, 8, False, torch.float32)
    x = torch.randn(33, 48, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_linear(x, projection)
    activations = sorted(tuple(t.shape) for t in saved if t.shape[0] == 33)
    assert activations == [(33, 8), (33, 48)]  # x A^T and x; no [tokens, out] tensor
    params = {id(projection.weight), id(projection.lora_a), id(projection.lora_b)}
    assert all(id(t) in params for t in saved if t.shape[0] != 33)


def test_a_packed_base_is_dequantised_in_forward_and_backward_and_never_kept():
    # a stand-in for bitsandbytes' 4-bit weight: int8 codes and one scale per row, expanded by the hook
    g = torch.Generator().manual_seed(4)
    full = make_projection(g, 48, 96, 4, True, torch.float32)
    scales = full.weight.abs().amax(1, keepdim=True) / 127
    codes = torch.round(full.weight / scales).to(torch.int8)
    calls = []

    def dequantize(weight):
        calls.append(weight)
        return weight.float() * scales

    packed = full._replace(weight=codes, dequantize=dequantize)
    unpacked = fresh(full)._replace(weight=codes.float() * scales)
    x = torch.randn(7, 48, generator=g)
    upstream = torch.randn(7, 96, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got, got_grads = run(lambda t: lora_linear(t, packed), x, upstream, packed)
    assert len(calls) == 2 and all(c is codes for c in calls)  # once in the forward, once in the backward
    assert not any(t.dtype == torch.float32 and t.shape == (96, 48) for t in saved)  # no full-precision copy kept
    want, want_grads = run(lambda t: lora_linear_reference(t, unpacked), x, upstream, unpacked)
    assert_close(got, want, name="output")
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b, name="gradient")


def test_autocast_runs_the_gemms_in_its_dtype_and_returns_fp32_adapter_gradients():
    # peft's default: fp32 adapters on a bf16 base, under bf16 autocast
    g = torch.Generator().manual_seed(5)
    projection = make_projection(g, 48, 96, 4, True, torch.bfloat16, adapter_dtype=torch.float32)
    projection = projection._replace(bias=projection.bias.detach())  # the base's bias is frozen, as under LoRA
    x = torch.randn(7, 48, generator=g).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora_linear(x, projection)
        want = lora_linear_reference(x, projection._replace(lora_a=projection.lora_a.to(torch.bfloat16),
                                                            lora_b=projection.lora_b.to(torch.bfloat16)))  # fmt: skip
    assert out.dtype == torch.bfloat16
    assert_close(out, want, "bf16", name="output")
    out.sum().backward()
    assert projection.lora_a.grad.dtype == torch.float32 and projection.lora_b.grad.dtype == torch.float32
    assert x.grad.dtype == torch.bfloat16


def test_a_trainable_base_weight_is_refused():
    g = torch.Generator().manual_seed(6)
    projection = make_projection(g, 8, 8, 2, False, torch.float32)
    projection.weight.requires_grad_()
    with pytest.raises(ValueError, match="keep the base weight frozen.*requires_grad_"):
        lora_linear(torch.randn(3, 8), projection)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error over the largest reference magnitude (the repo's check for bf16 GEMMs of thousands of terms)."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.cuda
def test_w1_shapes_on_cuda():
    # W1: 4096 tokens, hidden 1536 -> intermediate 8960 (the widest projection), rank 64, bf16
    g = torch.Generator().manual_seed(7)
    projection = make_projection(g, 1536, 8960, 64, True, torch.bfloat16)
    projection = LoRAProjection(*[t.cuda() if torch.is_tensor(t) else t for t in projection])
    projection = fresh(projection)
    x = torch.randn(4096, 1536, generator=g).to(torch.bfloat16).cuda()
    upstream = torch.randn(4096, 8960, generator=g).to(torch.bfloat16).cuda()
    got, got_grads = run(lambda t: lora_linear(t, projection), x, upstream, projection)
    exact = fresh(LoRAProjection(*[t.double() if torch.is_tensor(t) else t for t in projection]))
    want, want_grads = run(lambda t: lora_linear_reference(t, exact), x.double(), upstream.double(), exact)
    assert relative_error(got, want) < 0.02
    for name, a, b in zip(["x", "bias", "lora_a", "lora_b"], got_grads, want_grads, strict=True):
        assert relative_error(a, b) < 0.02, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_writes_one_scaled_gemm_over_whatever_was_there(dtype):
    """The backward's scaled GEMMs: alpha inside the GEMM equals the product then the scale (fp32 exactly; bf16 within
    one rounding), written into a column slice of a NaN-filled buffer without reading it or touching its neighbours."""
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(9, 33, generator=g).to(dtype), torch.randn(33, 5, generator=g).to(dtype)
    buffer = torch.full((9, 12), float("nan"), dtype=dtype)
    got = scaled_mm(a, b, 0.37, out=buffer[:, 4:9])
    want = (a.double() @ b.double()) * 0.37
    assert got.data_ptr() == buffer[:, 4:9].data_ptr() and not got.isnan().any()
    assert buffer[:, :4].isnan().all() and buffer[:, 9:].isnan().all()
    assert_close(got, want, "fp32" if dtype == torch.float32 else "bf16", name="scaled product")
    assert_close(scaled_mm(a, b, 0.37), want, "fp32" if dtype == torch.float32 else "bf16", name="new tensor")
