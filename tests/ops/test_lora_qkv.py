"""The fused q/k/v projections with the rotation inside (`ops.lora_qkv`) against peft's three LoRA Linears and
transformers' rotation: output and the gradient of the input and of every LoRA matrix and bias at odd shapes (heads not
a power of two, grouped K/V heads, ranks and scales differing per projection, cos shared over the batch or not) in
fp32 and bf16 (the rotation in Triton's interpreter on the CPU); gradcheck in fp64 (the rotation's reference); what it
saves; the dequantize hook; a rotation it does not take; fast LoRA's attention block with it against the model's own
(Qwen3's q/k norms, Mistral's window) and what keeps the separate projections; and, on a GPU, W1's shapes."""

from __future__ import annotations

import pytest
import torch

from slimrl.models import fast_lora
from slimrl.models.fast_lora import enable_fast_lora
from slimrl.ops import lora_qkv as qkv_ops
from slimrl.ops.lora_qkv import LoRAQKVFunction, lora_qkv, lora_qkv_reference
from tests.ops.test_lora_linear import fresh, leaves, make_projection, relative_error
from tests.ops.test_lora_mlp import full_fp32_matmuls, on_device, scaled
from tests.ops.test_rope import step, tiny, trig
from tests.tolerances import assert_close

# (batch, tokens, hidden, q_heads, kv_heads, head_dim, ranks, bias, cos_batch)
CASES = [(2, 5, 48, 3, 1, 16, (4, 8, 4), True, 1), (1, 1, 40, 6, 2, 8, (4, 4, 4), False, 1),
         (3, 7, 48, 5, 5, 10, (8, 4, 2), True, 3)]  # fmt: skip


def make_qkv(g, hidden, q_heads, kv_heads, head_dim, ranks, bias, dtype, **kwargs):
    widths = (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    return [make_projection(g, hidden, width, rank, bias, dtype, scale=scale, **kwargs)
            for width, rank, scale in zip(widths, ranks, (2.0, 0.5, 1.5), strict=True)]  # fmt: skip


def compare(projections, x, head_dim, rotation, kind):
    """Outputs and every gradient, fused against the reference (bf16: relative to each tensor's largest magnitude, the
    sums over tokens at bf16_sum, as tests/ops/test_lora_mlp.py does)."""
    g = torch.Generator().manual_seed(9)
    fused, reference = [fresh(p) for p in projections], [fresh(p) for p in projections]
    results = []
    for function, ps in ((lora_qkv, fused), (lora_qkv_reference, reference)):
        leaf = x.detach().clone().requires_grad_()
        outs = function(leaf, *ps, head_dim, *rotation)
        upstream = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs] if not results else results[0][2]
        params = [t for p in ps for t in leaves(p)]
        results.append(([o.detach() for o in outs], torch.autograd.grad(outs, [leaf, *params], upstream), upstream))
    (got, got_grads, _), (want, want_grads, _) = results
    for name, a, b in zip(("query", "key", "value"), got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        if kind == "fp32":
            assert_close(a, b, "fp32", name=name)
        else:
            assert_close(scaled(a, b), scaled(b, b), "bf16", name=f"{name} / its largest magnitude")
    for index, (a, b) in enumerate(zip(got_grads, want_grads, strict=True)):
        sum_kind = "grad_fp32" if kind == "fp32" else ("bf16" if index == 0 else "bf16_sum")
        assert_close(scaled(a, b), scaled(b, b), sum_kind, name=f"gradient {index} / its largest magnitude")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, tokens, hidden, q_heads, kv_heads, head_dim, ranks, bias, cos_batch", CASES)
@pytest.mark.parametrize("rotate", [True, False])
def test_forward_and_every_gradient_match_peft_and_transformers(batch, tokens, hidden, q_heads, kv_heads, head_dim,
                                                                 ranks, bias, cos_batch, rotate, dtype):  # fmt: skip
    g = torch.Generator().manual_seed(tokens * 10 + head_dim)
    projections = make_qkv(g, hidden, q_heads, kv_heads, head_dim, ranks, bias, dtype)
    x = torch.randn(batch, tokens, hidden, generator=g).to(dtype)
    rotation = trig(cos_batch, tokens, head_dim, dtype) if rotate else ()
    compare(projections, x, head_dim, rotation, "fp32" if dtype == torch.float32 else "bf16")


@pytest.mark.parametrize("rotate", [True, False])
def test_gradcheck_in_float64(rotate):
    g = torch.Generator().manual_seed(2)
    projections = make_qkv(g, 9, 2, 1, 4, (3, 2, 2), True, torch.float64)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64, requires_grad=True)
    cos, sin = trig(1, 3, 4, torch.float64)
    spec = qkv_ops._Spec((0.7, 1.3, 2.0), (None, None, None), (2, 3) if rotate else None, 4, False)

    def function(x, *trainable):
        tensors = []
        for p, (bias, lora_a, lora_b) in zip(projections, (trainable[i : i + 3] for i in (0, 3, 6)), strict=True):
            tensors += [p.weight, bias, lora_a, lora_b]
        return LoRAQKVFunction.apply(x, spec, cos if rotate else None, sin if rotate else None, *tensors)

    assert torch.autograd.gradcheck(function, (x, *[t for p in projections for t in leaves(p)]))


def test_gradients_of_any_layout_reach_the_same_result():
    """Upstream gradients in another layout than the outputs' (column-major [tokens, width] here: the rotation's
    kernel reads rows with a contiguous last dimension only) give the same gradients as contiguous ones."""
    g = torch.Generator().manual_seed(6)
    projections = make_qkv(g, 48, 3, 1, 16, (4, 8, 4), True, torch.float32)
    x = torch.randn(10, 48, generator=g)
    cos, sin = trig(2, 5, 16, torch.float32)
    spec = qkv_ops._Spec((2.0, 0.5, 1.5), (None, None, None), (2, 5), 16, qkv_ops.kernels.runs_here(x))
    upstream = [torch.randn(10, width, generator=g) for width in (48, 16, 16)]
    results = []
    for grads in (upstream, [u.t().contiguous().t() for u in upstream]):
        ps, leaf = [fresh(p) for p in projections], x.clone().requires_grad_()
        tensors = [t for p in ps for t in (p.weight, p.bias, p.lora_a, p.lora_b)]
        outs = LoRAQKVFunction.apply(leaf, spec, cos, sin, *tensors)
        results.append(torch.autograd.grad(outs, [leaf, *[t for p in ps for t in leaves(p)]], grads))
    assert not upstream[0].t().contiguous().t().is_contiguous()
    for a, b in zip(*results, strict=True):
        assert_close(a, b, "fp32", name="gradient")


def test_saves_x_the_shrinks_and_the_stacked_a_only():
    g = torch.Generator().manual_seed(3)
    projections = make_qkv(g, 48, 3, 1, 16, (4, 8, 4), False, torch.float32)
    x = torch.randn(2, 5, 48, generator=g, requires_grad=True)
    cos, sin = trig(1, 5, 16, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lora_qkv(x, *projections, 16, cos, sin)
    activations = sorted(tuple(t.shape) for t in saved if t.shape[0] == 10)
    assert activations == [(10, 16), (10, 48)]  # the three shrinks in one tensor, and x; no [tokens, out] tensor
    weights = {id(t) for p in projections for t in (p.weight, p.lora_a, p.lora_b)}
    others = sorted(tuple(t.shape) for t in saved if t.shape[0] != 10 and id(t) not in weights)
    assert others == [(1, 5, 16), (1, 5, 16), (16, 48)]  # cos, sin and [A_q; A_k; A_v]


def test_a_packed_base_is_dequantised_per_projection_in_forward_and_backward():
    g = torch.Generator().manual_seed(4)
    full = make_qkv(g, 48, 3, 1, 16, (4, 4, 4), True, torch.float32)
    calls, packed, unpacked = [], [], []
    for p in full:
        scales = p.weight.abs().amax(1, keepdim=True) / 127
        codes = torch.round(p.weight / scales).to(torch.int8)

        def dequantize(weight, scales=scales):
            calls.append(weight)
            return weight.float() * scales

        packed.append(p._replace(weight=codes, dequantize=dequantize))
        unpacked.append(fresh(p)._replace(weight=codes.float() * scales))
    x = torch.randn(2, 5, 48, generator=g, requires_grad=True)
    cos, sin = trig(2, 5, 16, torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs = lora_qkv(x, *packed, 16, cos, sin)
    # dequantised once per projection, and no full-precision base ([48, 48] for q, [16, 48] for k and v) kept
    assert len(calls) == 3 and not any(t.dtype == torch.float32 and tuple(t.shape) in {(48, 48), (16, 48)}
                                       for t in saved)  # fmt: skip
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert len(calls) == 6 and [id(c) for c in calls[3:]] == [id(p.weight) for p in packed]
    compare(packed, x, 16, (cos, sin), "fp32")
    compare(unpacked, x, 16, (cos, sin), "fp32")


def test_a_rotation_it_does_not_take_is_applied_after_it(monkeypatch):
    """cos and sin in fp32 for a bf16 compute (a promoting product, left to eager) and cos needing a gradient: the
    Function runs without the rotation and `ops.rope.rope` rotates its outputs."""
    g = torch.Generator().manual_seed(5)
    projections = make_qkv(g, 48, 3, 1, 16, (4, 4, 4), False, torch.bfloat16)
    x = torch.randn(2, 5, 48, generator=g).to(torch.bfloat16)
    after = []
    original = qkv_ops.rope
    monkeypatch.setattr(qkv_ops, "rope", lambda *a: after.append(1) or original(*a))
    cos, sin = trig(1, 5, 16, torch.float32)
    got = lora_qkv(x, *projections, 16, cos, sin)
    want = lora_qkv_reference(x, *projections, 16, cos, sin)
    assert len(after) == 1 and all(a.dtype == b.dtype for a, b in zip(got, want, strict=True))
    for a, b in zip(got, want, strict=True):
        assert_close(scaled(a, b), scaled(b, b), "bf16", name="output / its largest magnitude")
    cos32, sin32 = trig(1, 5, 16, torch.float32)
    projections32 = make_qkv(g, 48, 3, 1, 16, (4, 4, 4), False, torch.float32)
    compare(projections32, x.float(), 16, (cos32.requires_grad_(), sin32), "fp32")
    assert len(after) == 2
    with pytest.raises(ValueError, match="both cos and sin"):
        lora_qkv(x, *projections, 16, cos, None)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_attention_block_with_fused_qkv_against_the_models_own(arch, monkeypatch):
    """fast LoRA's attention block (q/k/v fused, the rotation inside; Qwen3 rotating after its q/k norms) against
    the model with fast LoRA off, in fp32: logits and every LoRA gradient (relative to each tensor's scale)."""
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 13, 14, 15]])
    mask = (ids != 0).long()
    plain, fast = tiny(arch, torch.float32).train(), tiny(arch, torch.float32).train()
    enable_fast_lora(fast)
    calls = []
    original = fast_lora.lora_qkv
    monkeypatch.setattr(fast_lora, "lora_qkv", lambda *a: calls.append(len(a)) or original(*a))
    got, want = step(fast, ids, mask), step(plain, ids, mask)
    assert calls == [5 if arch == "qwen3" else 7] * 2  # both layers; Qwen3 passes no rotation
    assert_close(got[0], want[0], "fp32", name="logits")
    assert got[1].keys() == want[1].keys() and got[1]
    for name, grad in want[1].items():
        assert_close(got[1][name] / grad.abs().max(), grad / grad.abs().max(), "grad_fp32", name=name)


def test_what_keeps_the_projections_separate(monkeypatch):
    """A forward hook on q_proj (a direct call would skip it) or a k_proj that is not LoRA: each projection through
    its own forward, the hook runs, and the block still equals the model's own."""
    from peft import LoraConfig, get_peft_model

    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.ones_like(ids)
    calls = []
    original = fast_lora.lora_qkv
    monkeypatch.setattr(fast_lora, "lora_qkv", lambda *a: calls.append(1) or original(*a))
    hooked, plain = tiny("llama", torch.float32).train(), tiny("llama", torch.float32).train()
    seen = []
    hooked.base_model.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: seen.append(1))
    enable_fast_lora(hooked)
    got, want = step(hooked, ids, mask), step(plain, ids, mask)
    assert len(calls) == 1 and len(seen) == 1  # layer 1 fused; layer 0's hook ran
    assert_close(got[0], want[0], "fp32", name="logits")
    base = tiny("llama", torch.float32).unload()  # the transformers model without its LoRA layers
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj", "o_proj"])
    partial = get_peft_model(base, lora)
    enable_fast_lora(partial)
    calls.clear()
    step(partial, ids, mask)
    assert calls == []


@pytest.mark.cuda
def test_w1_shapes_on_cuda():
    """Qwen2.5-1.5B's attention projections (hidden 1536, 12 query heads, 2 key/value heads, head_dim 128, bias, r=64)
    at 4,096 tokens in bf16 against the fp32 reference; the in-place rotation with the out-of-place kernel's bits."""
    g = torch.Generator().manual_seed(18)
    projections = [on_device(p, "cuda") for p in make_qkv(g, 1536, 12, 2, 128, (64, 64, 64), True, torch.bfloat16)]
    x = torch.randn(2, 2048, 1536, generator=g).to(torch.bfloat16).cuda()
    cos, sin = (t.cuda() for t in trig(1, 2048, 128, torch.bfloat16))
    upstream = [torch.randn(2, 2048, heads, 128, generator=g).to(torch.bfloat16).cuda() for heads in (12, 2, 2)]

    def both(function, ps, x, rotation):
        leaf = x.detach().clone().requires_grad_()
        outs = function(leaf, *ps, 128, *rotation)
        grads = torch.autograd.grad(outs, [leaf, *[t for p in ps for t in leaves(p)]],
                                    [u.to(outs[0].dtype) for u in upstream])  # fmt: skip
        return outs, grads

    got, got_grads = both(lora_qkv, projections, x, (cos, sin))
    exact = [on_device(p, "cuda", torch.float32) for p in projections]
    with full_fp32_matmuls():
        want, want_grads = both(lora_qkv_reference, exact, x.float(), (cos.float(), sin.float()))
    for a, b in zip((*got, *got_grads), (*want, *want_grads), strict=True):
        assert relative_error(a, b) < 0.02
    from slimrl.ops.kernels.rope import rope as kernel
    from slimrl.ops.kernels.rope import rotate_

    plain = lora_qkv(x, *projections, 128)
    expected = kernel(plain[0], plain[1], cos, sin)
    q, k = plain[0].clone(), plain[1].clone()
    rotate_(q, k, cos, sin)
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1]) and torch.equal(got[0], expected[0])
