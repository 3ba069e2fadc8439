"""The gated product's Triton kernels (`ops.kernels.glu`: SwiGLU and GELU-tanh, forward and the in-place backward)
against eager PyTorch (the model's act_fn, then the product) and its autograd, in Triton's interpreter on the CPU and
compiled at W1's MLP width on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimrl.ops.lora_mlp import glu_backward_reference, glu_reference
from tests.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernels run in Triton's interpreter
KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def eager(activation: str):
    if activation == "silu":
        return F.silu
    return lambda g: F.gelu(g, approximate="tanh")


def autograd_backward(gate, up, grad_h, activation):
    """(h, d gate, d up) from eager PyTorch's own autograd."""
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = eager(activation)(gate) * up
    h.backward(grad_h)
    return h.detach(), gate.grad, up.grad


def inputs(seed, shape, dtype):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [(3 * torch.randn(shape, generator=g, device=DEVICE)).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 136), (7, 136), (33, 136)])
def test_forward_and_backward_match_eager(shape, dtype, activation):
    from slimrl.ops.kernels.glu import glu_backward_, glu_forward

    gate, up, grad_h = inputs(shape[0], shape, dtype)
    kind = KINDS[dtype]
    assert_close(*on_scale(glu_forward(gate, up, activation), eager(activation)(gate) * up, kind), name="h")
    want = autograd_backward(gate, up, grad_h, activation)
    buffers = [grad_h.clone(), gate.clone(), up.clone()]
    glu_backward_(*buffers, activation)
    for name, got, expected in zip(("h", "d gate", "d up"), buffers, want, strict=True):
        assert_close(*on_scale(got, expected, kind), name=name)


def on_scale(got, expected, kind):
    """(got, expected, kind) to compare. In fp32 relative to the tensor's largest magnitude: act and its slope hold
    1 + t and 1 - t^2 with t = tanh(z) near -1 (and silu's sigmoid near 0), which cancel, so eager's own fp32 result
    near zero carries an absolute error of the order of the ulps of its O(1) terms; bf16 and fp16 element-wise."""
    if kind != "fp32":
        return got, expected, kind
    scale = expected.abs().max()
    return got / scale, expected / scale, "grad_fp32"


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_pytorch_fallback_rounds_as_the_kernel(activation):
    # the path that runs where Triton does not (and in fp64 for gradcheck): same formula, same rounding points
    gate, up, grad_h = inputs(5, (7, 136), torch.bfloat16)
    assert_close(glu_reference(gate, up, activation), eager(activation)(gate) * up, "bf16", name="h")
    for name, got, expected in zip(("h", "d gate", "d up"), glu_backward_reference(grad_h, gate, up, activation),
                                   autograd_backward(gate, up, grad_h, activation), strict=True):  # fmt: skip
        assert_close(got, expected, "bf16", name=name)


def test_backward_writes_into_its_three_buffers_and_bumps_their_versions():
    from slimrl.ops.kernels.glu import glu_backward_

    gate, up, grad_h = inputs(6, (7, 136), torch.float32)
    pointers = [t.data_ptr() for t in (grad_h, gate, up)]
    versions = [t._version for t in (grad_h, gate, up)]
    want = autograd_backward(gate, up, grad_h, "silu")
    glu_backward_(grad_h, gate, up)
    assert [t.data_ptr() for t in (grad_h, gate, up)] == pointers
    assert all(t._version > v for t, v in zip((grad_h, gate, up), versions, strict=True))  # autograd sees the writes
    for got, expected in zip((grad_h, gate, up), want, strict=True):
        assert_close(got, expected, name="overwritten buffer")


def test_mismatched_or_strided_inputs_and_unknown_activations_are_refused():
    from slimrl.ops.kernels.glu import glu_forward

    gate, up, _ = inputs(7, (4, 16), torch.float32)
    with pytest.raises(ValueError, match="contiguous, of one shape and dtype"):
        glu_forward(gate, up.t().contiguous().t())
    with pytest.raises(ValueError, match="contiguous, of one shape and dtype"):
        glu_forward(gate, up.double())
    with pytest.raises(ValueError, match="activation must be one of"):
        glu_forward(gate, up, "relu")


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_w1_mlp_width_compiled_on_cuda(activation):
    from slimrl.ops.kernels.glu import glu_backward_, glu_forward

    gate, up, grad_h = inputs(8, (4096, 8960), torch.bfloat16)  # W1: 4096 tokens, intermediate 8960, bf16
    assert_close(glu_forward(gate, up, activation), eager(activation)(gate) * up, "bf16", name="h")
    want = autograd_backward(gate, up, grad_h, activation)
    glu_backward_(grad_h, gate, up, activation)
    for name, got, expected in zip(("h", "d gate", "d up"), (grad_h, gate, up), want, strict=True):
        assert_close(got, expected, "bf16", name=name)
