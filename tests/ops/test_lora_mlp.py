"""The fused LoRA MLP (`ops.lora_mlp`) against peft's three LoRA Linears around the model's gated product: output and
the gradient of the input and of every LoRA matrix and bias, at odd shapes, SiLU and GELU-tanh, fp32 and bf16 (the
gated product in Triton's interpreter on the CPU); gradcheck in fp64; what it saves and that its backward allocates
no [tokens, intermediate] tensor beyond those; the dequantize hook; and, on a GPU, W1's shapes."""

from __future__ import annotations

import pytest
import torch

from slimrl.ops import kernels
from slimrl.ops import lora_mlp as mlp_ops
from slimrl.ops.lora_mlp import ACTIVATIONS, LoRAMLPFunction, _Spec, lora_mlp, lora_mlp_reference, output_unread
from tests.ops.test_lora_linear import KINDS, fresh, leaves, make_projection, relative_error, run
from tests.tolerances import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU the gated product runs in Triton's interpreter
# (tokens, hidden, intermediate, rank, bias)
CASES = [(1, 48, 136, 4, True), (7, 96, 136, 8, False), (33, 48, 136, 8, False), (33, 96, 136, 4, True)]


def make_mlp(g, hidden, intermediate, rank, bias, dtype, **kwargs):
    gate = make_projection(g, hidden, intermediate, rank, bias, dtype, scale=2.0, **kwargs)
    up = make_projection(g, hidden, intermediate, rank, bias, dtype, scale=0.5, **kwargs)
    down = make_projection(g, intermediate, hidden, rank, bias, dtype, scale=1.5, **kwargs)
    return gate, up, down


def scaled(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return tensor.double() / scale.double().abs().max().clamp_min(1e-30)


def on_device(projection, device, dtype=None):
    """The projection's tensors on `device` (and in `dtype`), as fresh leaves."""
    return fresh(type(projection)(*[t.to(device, dtype) if torch.is_tensor(t) else t for t in projection]))


def compare(mlp, x, upstream, kind, activation="silu"):
    """Output and every gradient, fused against peft's formula.

    fp32: each gradient is a sum of a few hundred products taken in another order (and the gated product's exp is
    Triton's, not PyTorch's), compared relative to its tensor's largest magnitude (grad_fp32).
    bf16: a chain of three GEMMs over 48-136 terms whose intermediates (gate, up, h, dH) are rounded to 8 bits, at
    other points in each path; an output near zero from cancelling O(3) terms then carries an absolute error of the
    terms' scale, not its own. So both sides are divided by the reference's largest magnitude first (as the table's
    grad_fp32 entry does): bf16 for the output and x's gradient, bf16_sum for the sums over tokens."""
    fused, reference = [fresh(p) for p in mlp], [fresh(p) for p in mlp]
    got, got_grads = run(lambda t: lora_mlp(t, *fused, activation=activation), x, upstream, *fused)
    want, want_grads = run(lambda t: lora_mlp_reference(t, *reference, activation=activation), x, upstream,
                           *reference)  # fmt: skip
    names = ["x"] + [f"{p}.{t}" for p, proj in zip(("gate", "up", "down"), mlp, strict=True)
                     for t in (["bias"] if proj.bias is not None else []) + ["lora_a", "lora_b"]]  # fmt: skip
    assert got.dtype == x.dtype and len(names) == len(got_grads)
    if kind == "fp32":
        assert_close(got, want, "fp32", name="output")
        for name, a, b in zip(names, got_grads, want_grads, strict=True):
            assert_close(scaled(a, b), scaled(b, b), "grad_fp32", name=f"grad of {name} / its largest magnitude")
        return
    assert_close(scaled(got, want), scaled(want, want), "bf16", name="output / its largest magnitude")
    for name, a, b in zip(names, got_grads, want_grads, strict=True):
        assert_close(scaled(a, b), scaled(b, b), "bf16" if name == "x" else "bf16_sum",
                     name=f"grad of {name} / its largest magnitude")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, intermediate, rank, bias", CASES)
def test_forward_and_every_gradient_match_peft(tokens, hidden, intermediate, rank, bias, dtype):
    g = torch.Generator().manual_seed(tokens * 10 + hidden)
    mlp = [on_device(p, DEVICE) for p in make_mlp(g, hidden, intermediate, rank, bias, dtype)]
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    upstream = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    assert kernels.runs_here(x)  # the gated product runs in Triton (compiled on CUDA, else the interpreter)
    compare(mlp, x, upstream, KINDS[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_as_gemma_computes_it(dtype):
    g = torch.Generator().manual_seed(11)
    mlp = make_mlp(g, 48, 136, 4, False, dtype)
    x = torch.randn(2, 7, 48, generator=g).to(dtype)  # a batch dimension as the model passes it
    compare(mlp, x, torch.randn(2, 7, 48, generator=g).to(dtype), KINDS[dtype], activation="gelu_tanh")


def test_ranks_and_scales_may_differ_between_projections():
    # peft's rank_pattern / alpha_pattern: the shared shrink of gate and up then splits at gate's rank
    g = torch.Generator().manual_seed(12)
    gate = make_projection(g, 48, 136, 3, False, torch.float32, scale=4.0)
    up = make_projection(g, 48, 136, 8, False, torch.float32, scale=0.25)
    down = make_projection(g, 136, 48, 5, False, torch.float32)
    x, upstream = torch.randn(7, 48, generator=g), torch.randn(7, 48, generator=g)
    compare((gate, up, down), x, upstream, "fp32")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_in_float64(activation):
    g = torch.Generator().manual_seed(13)
    mlp = make_mlp(g, 6, 10, 2, True, torch.float64)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    params = [t for p in mlp for t in leaves(p)]
    spec = _Spec(tuple(p.scale for p in mlp), (None, None, None), activation, in_place=False)

    def function(x, *trainable):
        it = iter(trainable)
        tensors = [t for p in mlp for t in (p.weight, next(it), next(it), next(it))]
        return LoRAMLPFunction.apply(x, spec, *tensors)

    assert torch.autograd.gradcheck(function, (x, *params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hidden, intermediate, rank, bias", CASES[1:3])
def test_an_unread_output_skips_down_and_leaves_every_gradient_the_same_bits(tokens, hidden, intermediate, rank,
                                                                           bias, dtype, monkeypatch):  # fmt: skip
    g = torch.Generator().manual_seed(tokens + rank)
    mlp = [on_device(p, DEVICE) for p in make_mlp(g, hidden, intermediate, rank, bias, dtype)]
    x = torch.randn(3, tokens, hidden, generator=g).to(DEVICE, dtype)  # a leading batch dimension too
    upstream = torch.randn(3, tokens, hidden, generator=g).to(DEVICE, dtype)
    projected, products = [], []  # the output features of every base GEMM the forwards run; gated products
    original, glu = mlp_ops.project, mlp_ops._glu
    monkeypatch.setattr(mlp_ops, "project", lambda x, w, *a: projected.append(w.shape[0]) or original(x, w, *a))
    monkeypatch.setattr(mlp_ops, "_glu", lambda *a: products.append(1) or glu(*a))
    read = [fresh(p) for p in mlp]
    out, want = run(lambda t: lora_mlp(t, *read), x, upstream, *read)
    assert projected == [intermediate, intermediate, hidden] and len(products) == 1
    unread, projected[:], products[:] = [fresh(p) for p in mlp], [], []
    with output_unread():
        skipped, got = run(lambda t: lora_mlp(t, *unread), x, upstream, *unread)
    # gate and up only: down's GEMM and expand and the gated product's forward were skipped
    assert projected == [intermediate, intermediate] and not products
    assert skipped.shape == out.shape and skipped.dtype == out.dtype
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    projected[:] = []
    lora_mlp(x, *mlp)  # the mode ends with its block
    assert len(projected) == 3


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_backward_references_h_has_the_forward_references_bits(activation, dtype):
    """Off the kernels an unread forward takes h A_d^T from the backward's h: it must be the forward's, bit for bit."""
    g = torch.Generator().manual_seed(21)
    gate, up, grad = (torch.randn(57, 136, generator=g).mul(4).to(dtype) for _ in range(3))
    h, _, _ = mlp_ops.glu_backward_reference(grad, gate, up, activation)
    assert torch.equal(h, mlp_ops.glu_reference(gate, up, activation))


def test_saves_x_gate_up_and_the_shrinks_only():
    g = torch.Generator().manual_seed(14)
    mlp = make_mlp(g, 48, 136, 8, False, torch.float32)
    x = torch.randn(33, 48, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_mlp(x, *mlp)
    activations = sorted(tuple(t.shape) for t in saved if t.shape[0] == 33)
    # x, gate, up, [x A_gate^T, x A_up^T] in one, h A_down^T; not h nor act(gate)
    assert activations == [(33, 8), (33, 16), (33, 48), (33, 136), (33, 136)]


def test_backward_overwrites_gate_and_up_in_place_and_a_second_backward_fails_loudly():
    g = torch.Generator().manual_seed(15)
    mlp = [fresh(p) for p in make_mlp(g, 48, 136, 4, False, torch.float32)]
    x = torch.randn(7, 48, generator=g, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = lora_mlp(x, *mlp)
    gate, up = [t for t in saved if tuple(t.shape) == (7, 136)]
    before = gate.clone(), up.clone()
    out.sum().backward()
    assert not torch.equal(gate, before[0]) and not torch.equal(up, before[1])  # their buffers now hold d gate, d up
    out = lora_mlp(x, *mlp)  # (without hooks: autograd checks saved tensors' versions only for its own saves)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    keep = [fresh(p) for p in mlp]
    again = lora_mlp(x, *keep, in_place=False)
    again.sum().backward(retain_graph=True)
    first = keep[0].lora_a.grad.clone()
    again.sum().backward()  # in_place=False: gate and up survive, and the second pass adds the same gradient
    assert_close(keep[0].lora_a.grad, 2 * first, name="twice-accumulated grad of gate.lora_a")


def test_a_packed_base_is_dequantised_per_projection_in_forward_and_backward():
    g = torch.Generator().manual_seed(16)
    mlp = make_mlp(g, 48, 136, 4, False, torch.float32)
    calls = []
    scales = [p.weight.abs().amax(1, keepdim=True) / 127 for p in mlp]

    def packed(projection, scale):
        def dequantize(weight):
            calls.append(weight)
            return weight.float() * scale

        return projection._replace(weight=torch.round(projection.weight / scale).to(torch.int8), dequantize=dequantize)

    quantised = [packed(p, s) for p, s in zip(mlp, scales, strict=True)]
    unpacked = [fresh(p)._replace(weight=q.weight.float() * s) for p, q, s in zip(mlp, quantised, scales, strict=True)]
    x, upstream = torch.randn(7, 48, generator=g), torch.randn(7, 48, generator=g)
    got, got_grads = run(lambda t: lora_mlp(t, *quantised), x, upstream, *quantised)
    assert len(calls) == 6  # each of the three in the forward and again in the backward
    want, want_grads = run(lambda t: lora_mlp_reference(t, *unpacked), x, upstream, *unpacked)
    assert_close(got, want, name="output")
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b, "grad_fp32", name="gradient")


def test_an_unknown_activation_is_refused():
    g = torch.Generator().manual_seed(17)
    with pytest.raises(ValueError, match="activation must be one of"):
        lora_mlp(torch.randn(2, 8), *make_mlp(g, 8, 16, 2, False, torch.float32), activation="relu")


@pytest.mark.cuda
def test_w1_shapes_on_cuda():
    # W1's MLP: 4096 tokens, hidden 1536, intermediate 8960, rank 64, bf16, the gated product compiled by Triton
    g = torch.Generator().manual_seed(18)
    mlp = [on_device(p, "cuda") for p in make_mlp(g, 1536, 8960, 64, False, torch.bfloat16)]
    x = torch.randn(4096, 1536, generator=g).to(torch.bfloat16).cuda()
    upstream = torch.randn(4096, 1536, generator=g).to(torch.bfloat16).cuda()
    got, got_grads = run(lambda t: lora_mlp(t, *mlp), x, upstream, *mlp)
    exact = [on_device(p, "cuda", torch.float32) for p in mlp]
    with full_fp32_matmuls():
        want, want_grads = run(lambda t: lora_mlp_reference(t, *exact), x.float(), upstream.float(), *exact)
    assert relative_error(got, want) < 0.02
    for a, b in zip(got_grads, want_grads, strict=True):
        assert relative_error(a, b) < 0.02
    # a recompute's unread output: the same gradients, bit for bit (h A_d^T from the backward kernel's h)
    with output_unread():
        _, unread_grads = run(lambda t: lora_mlp(t, *mlp), x, upstream, *mlp)
    for a, b in zip(unread_grads, got_grads, strict=True):
        assert torch.equal(a, b)


class full_fp32_matmuls:
    """The fp32 reference without TF32 (whatever the process set): the truth the bf16 path is held to."""

    def __enter__(self):
        self.before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.before
