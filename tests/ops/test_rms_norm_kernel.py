"""RMSNorm's Triton kernels (`ops.kernels.rms_norm`) against the model's formula (`ops.fused.rms_norm_reference`)
and its autograd: output, input gradient and weight gradient (per-program shares added after the launch), in Triton's
interpreter on the CPU and compiled at W1's shapes on a GPU."""

from __future__ import annotations

import pytest
import torch

from slimrl.ops.fused import rms_norm_reference
from tests.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the kernels run in Triton's interpreter
KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def compare(shape, dtype, weight_dtype, weight_grad=True, seed=0, eps=1e-6):
    from slimrl.ops.kernels.rms_norm import rms_norm

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (3 * torch.randn(shape, generator=g, device=DEVICE)).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=g, device=DEVICE)).to(weight_dtype)
    upstream = torch.randn(shape, generator=g, device=DEVICE).to(torch.promote_types(dtype, weight_dtype))
    results = []
    for function in (rms_norm, rms_norm_reference):
        leaf, w = x.clone().requires_grad_(), weight.clone().requires_grad_(weight_grad)
        out = function(leaf, w, eps)
        out.backward(upstream)
        results.append((out.detach(), leaf.grad, w.grad))
    (got, got_dx, got_dw), (want, want_dx, want_dw) = results
    kind = KINDS[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, kind, name="output")
    assert_close(got_dx, want_dx, "fp32_sum" if kind == "fp32" else kind, name="grad of x")
    if not weight_grad:
        assert got_dw is None
    elif kind == "fp32":
        assert_close(got_dw, want_dw, "fp32_sum", name="grad of weight")  # the same sum in another order
    else:
        check_low_precision_weight_grad(got_dw, want_dw, x, upstream, eps)


def check_low_precision_weight_grad(got_dw, want_dw, x, upstream, eps):
    """dw = sum over rows of upstream * round(x * rstd): the kernel adds the exact products in fp32, eager rounds each
    product to bf16 before its (fp32) sum, so over W1's 4,096 rows eager's own error reaches several percent of a
    cancelling sum. Both are held to the sum in fp64 of the same rounded factors: the kernel within its one final
    rounding, eager within that plus a bf16 rounding of every product (what it does)."""
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).double()  # eager's
    terms = (upstream.double() * normed).reshape(-1, x.shape[-1])
    truth, magnitude = terms.sum(0), terms.abs().sum(0)
    # the result's rounding to bf16, fp32 summation, and a rare factor rounded the other way (an rstd 1 ulp apart)
    final_rounding = truth.abs() * 2**-8 + 1e-6 * magnitude + 2**-7 * terms.abs().amax(0)
    assert ((got_dw.double() - truth).abs() <= final_rounding).all(), "kernel's weight gradient off the exact sum"
    assert ((want_dw.double() - truth).abs() <= final_rounding + magnitude * 2**-8).all(), "eager off its bound"


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])  # fmt: skip
@pytest.mark.parametrize("shape", [(1, 48), (7, 96), (33, 96), (3, 11, 48)])
def test_forward_and_both_gradients_match_the_model(shape, dtype, weight_dtype):
    # 33 rows over 3 programs: shares of 11 rows; a 3-d batch as the model passes it
    compare(shape, dtype, weight_dtype, seed=shape[0])


def test_a_frozen_weight_gets_no_gradient():
    compare((7, 96), torch.bfloat16, torch.bfloat16, weight_grad=False)


def test_no_rows():
    from slimrl.ops.kernels.rms_norm import rms_norm

    weight = torch.ones(48, device=DEVICE, requires_grad=True)
    x = torch.empty(0, 48, device=DEVICE, requires_grad=True)
    out = rms_norm(x, weight, 1e-6)
    out.sum().backward()
    assert out.shape == (0, 48) and torch.equal(weight.grad, torch.zeros(48, device=DEVICE))


def test_a_weight_of_another_width_is_refused():
    from slimrl.ops.kernels.rms_norm import rms_norm

    with pytest.raises(ValueError, match="does not match hidden states of width 48"):
        rms_norm(torch.randn(3, 48, device=DEVICE), torch.ones(96, device=DEVICE), 1e-6)


@pytest.mark.cuda
def test_w1_shapes_compiled_on_cuda():
    compare((4096, 1536), torch.bfloat16, torch.bfloat16, seed=9)  # W1: 4096 tokens of hidden 1536, bf16
