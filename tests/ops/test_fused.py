"""Fused SwiGLU product and RMSNorm: the compiled fast path against the plain reference, forward and backward."""

import pytest
import torch

from slimrl.ops import fused
from slimrl.testing import tiny_model
from tests.tolerances import assert_close


def compare(reference, fast, *inputs):
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    expected = reference(*leaves)
    expected.backward(torch.ones_like(expected))
    expected_grads = [x.grad.clone() for x in leaves if x.requires_grad]
    fast_leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    actual = fast(*fast_leaves)
    actual.backward(torch.ones_like(actual))
    assert_close(actual, expected, name="output")
    for got, want in zip([x.grad for x in fast_leaves if x.requires_grad], expected_grads, strict=True):
        assert_close(got, want, name="grad")


@pytest.fixture(scope="module")
def compiled():
    # the CUDA fast path is the compiled reference; compiling it here on the CPU checks the same graph
    return {
        "silu_mul": torch.compile(fused.silu_mul_reference, dynamic=True, fullgraph=True),
        "rms_norm": torch.compile(fused.rms_norm_reference, dynamic=True, fullgraph=True),
    }


@pytest.mark.parametrize("shape", [(5, 123), (2, 7, 64)])
def test_compiled_silu_mul_matches_reference(compiled, shape):
    g = torch.Generator().manual_seed(0)
    compare(
        fused.silu_mul_reference, compiled["silu_mul"], torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    )


def test_compiled_rms_norm_matches_reference_and_the_model_norm(compiled):
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(3, 11, 64, generator=g), 1 + 0.1 * torch.randn(64, generator=g)
    compare(lambda a, w: fused.rms_norm_reference(a, w, 1e-6), lambda a, w: compiled["rms_norm"](a, w, 1e-6), x, weight)
    norm = tiny_model().model.layers[0].input_layernorm
    assert fused.fusable_norm(norm)
    assert_close(fused.norm_forward(norm, x), norm(x), name="model RMSNorm")


def test_mlp_forward_equals_the_model_mlp(arch):
    mlp = tiny_model(arch).model.layers[0].mlp
    assert fused.fusable_mlp(mlp)
    x = torch.randn(2, 5, 64)
    assert_close(fused.mlp_forward(mlp, x), mlp(x), name="MLP")


def test_unknown_modules_use_their_own_forward():
    linear = torch.nn.Linear(4, 4)
    assert not fused.fusable_mlp(linear) and not fused.fusable_norm(linear)
    x = torch.randn(2, 4)
    assert torch.equal(fused.mlp_forward(linear, x), linear(x)) and torch.equal(
        fused.norm_forward(linear, x), linear(x)
    )
