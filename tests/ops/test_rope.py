"""The rotary embedding kernels (`ops.kernels.rope`, under Triton's interpreter on the CPU) against transformers'
formula: forward and backward with eager's bits in fp32, bf16 and fp16 at odd shapes (heads not a power of two,
head_dim 80, one token, cos shared over the batch, strided inputs); and fast LoRA's attention forward against each
supported block's own (Llama, Qwen2, Qwen3, Mistral): output and gradients equal, cached calls left to the model."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.models.fast_lora import describe_fast_lora, disable_fast_lora, enable_fast_lora
from slimrl.ops import rope as rope_ops
from slimrl.ops.rope import kernel_takes, rope, rope_reference
from slimrl.testing import tiny_config

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def trig(batch, tokens, dim, dtype, seed=0):
    """cos and sin as a rotary embedding makes them: the angles' halves repeated, positions per batch row."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (batch, tokens), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[..., None] * inv
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qk(batch, tokens, heads, kv_heads, dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, tokens, heads, dim, generator=g) * 3).to(dtype)
    k = (torch.randn(batch, tokens, kv_heads, dim, generator=g) * 3).to(dtype)
    return q, k


SHAPES = [(2, 7, 3, 1, 16, 2), (1, 1, 4, 2, 8, 1), (3, 5, 12, 2, 80, 1), (2, 9, 6, 6, 32, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,tokens,heads,kv_heads,dim,cos_batch", SHAPES)
def test_forward_and_backward_have_eagers_bits(dtype, batch, tokens, heads, kv_heads, dim, cos_batch):
    q, k = qk(batch, tokens, heads, kv_heads, dim, dtype)
    cos, sin = trig(batch if cos_batch == 2 else 1, tokens, dim, dtype)
    assert kernel_takes(q, k, cos, sin)
    from slimrl.ops.kernels.rope import rope as kernel

    leaves = [t.clone().requires_grad_() for t in (q, k, q, k)]
    expected = rope_reference(leaves[0], leaves[1], cos, sin)
    got = kernel(leaves[2], leaves[3], cos, sin)
    g = torch.Generator().manual_seed(5)
    grads = [torch.randn(t.shape, generator=g).to(dtype) for t in expected]
    torch.autograd.backward(expected, grads)
    torch.autograd.backward(got, grads)
    for want, have, label in zip((*expected, leaves[0].grad, leaves[1].grad), (*got, leaves[2].grad, leaves[3].grad),
                                 ("q", "k", "d q", "d k"), strict=True):  # fmt: skip
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have, want), f"{label}: max diff {(have.float() - want.float()).abs().max()}"


def test_strided_inputs_and_one_missing_gradient():
    """q and k as views of one fused projection output (row stride wider than heads x dim), and a backward that
    reaches only q (k's gradient None)."""
    batch, tokens, heads, kv_heads, dim = 2, 6, 4, 2, 16
    fused = torch.randn(batch, tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
    q = fused[..., : heads * dim].view(batch, tokens, heads, dim)
    k = fused[..., heads * dim : (heads + kv_heads) * dim].view(batch, tokens, kv_heads, dim)
    cos, sin = trig(batch, tokens, dim, torch.bfloat16)
    want_q, want_k = rope_reference(q, k, cos, sin)
    got_q, got_k = rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    leaf_a, leaf_b = q.clone().requires_grad_(), q.clone().requires_grad_()
    rope_reference(leaf_a, k, cos, sin)[0].sum().backward()
    rope(leaf_b, k, cos, sin)[0].sum().backward()
    assert torch.equal(leaf_b.grad, leaf_a.grad)


def test_what_the_kernel_does_not_take_runs_the_reference(monkeypatch):
    q, k = qk(1, 3, 2, 1, 8, torch.bfloat16)
    cos, sin = trig(1, 3, 8, torch.float32)  # a promoting product: eager's fp32 result, left to eager
    assert not kernel_takes(q, k, cos, sin)
    odd_q, odd_k = qk(1, 3, 2, 1, 7, torch.float32)
    assert not kernel_takes(odd_q, odd_k, *trig(1, 3, 7, torch.float32)[:1] * 2)  # odd head_dim
    bf_cos, bf_sin = trig(1, 3, 8, torch.bfloat16)
    assert not kernel_takes(q, k, bf_cos.requires_grad_(), bf_sin)  # a cos that wants a gradient
    calls = []
    monkeypatch.setattr(rope_ops, "rope_reference", lambda *a: calls.append(1) or rope_reference(*a))
    out = rope(q, k, cos, sin)
    assert calls and out[0].dtype == torch.float32  # eager's promotion kept


# --- the attention forward of fast LoRA against each block's own ------------------------------------------------


def tiny(arch, dtype):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    if arch in ("llama", "qwen2"):
        config = tiny_config(arch)
    else:
        base = tiny_config("llama").to_dict()
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "pad_token_id", "eos_token_id", "tie_word_embeddings")
        fields = {key: base[key] for key in keep}
        config = Qwen3Config(head_dim=16, **fields) if arch == "qwen3" else MistralConfig(sliding_window=4, **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules="all-linear")
    return get_peft_model(model, lora)


def step(model, ids, mask):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False)  # training: no KV cache
    g = torch.Generator().manual_seed(2)
    out.logits.backward(torch.randn(out.logits.shape, generator=g).to(out.logits))
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# bf16 (the interpreter's slowest case) on llama and qwen3 only: qwen2's and mistral's attention rotate as llama's does
# (qwen2 adds biases to the projections before it, mistral a sliding window after it), and fp32 runs all four
@pytest.mark.parametrize("arch, dtype", [(arch, torch.float32) for arch in ("llama", "qwen2", "qwen3", "mistral")]
                         + [("llama", torch.bfloat16), ("qwen3", torch.bfloat16)])  # fmt: skip
def test_attention_forward_equals_the_blocks_own(arch, dtype, monkeypatch):
    """Two copies of one model, projections fused in both (peft's own forwards would differ in the last bits
    otherwise), one with the attention block switched: equal logits and LoRA gradients, bit for bit. The q/k/v
    projections stay separate here (the rotation after them, as where they cannot be fused together);
    tests/ops/test_lora_qkv.py covers the block with them fused and the rotation inside."""
    from slimrl.models import fast_lora
    from slimrl.ops.kernels import rope as rope_kernels

    monkeypatch.setattr(fast_lora, "_fused_qkv", lambda attn, hidden_states: None)

    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 13, 14, 15]])  # odd length, left padding (the interpreter is slow)
    mask = (ids != 0).long()
    plain, fast = tiny(arch, dtype).train(), tiny(arch, dtype).train()
    enable_fast_lora(plain, norms=False, attention=False)
    enable_fast_lora(fast, norms=False)
    assert describe_fast_lora(fast)["attention"] == 2 and describe_fast_lora(plain)["attention"] == 0
    calls = []
    apply = rope_kernels.RoPEFunction.apply
    monkeypatch.setattr(rope_kernels.RoPEFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    got = step(fast, ids, mask)
    assert len(calls) == 2  # the kernel ran in both layers
    want = step(plain, ids, mask)
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and got[1]
    for name, grad in want[1].items():
        assert torch.equal(got[1][name], grad), name


def test_generation_with_a_cache_takes_the_models_forward():
    model = tiny("qwen2", torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    want = model.generate(ids, max_new_tokens=5, do_sample=False)
    enable_fast_lora(model)
    got = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    assert disable_fast_lora(model) > 0 and describe_fast_lora(model)["attention"] == 0


@pytest.mark.cuda
def test_w1_shapes_on_cuda_have_eagers_bits(monkeypatch):
    """Qwen2.5-1.5B's attention shape (12 query heads, 2 key/value heads, head_dim 128) in bf16, compiled: forward and
    backward equal to eager's on the GPU; then a tiny Qwen2's attention block with and without the switch (q/k/v
    separate, as in the test above)."""
    from slimrl.models import fast_lora
    from slimrl.ops.kernels.rope import rope as kernel

    monkeypatch.setattr(fast_lora, "_fused_qkv", lambda attn, hidden_states: None)

    q, k = (t.cuda() for t in qk(2, 1031, 12, 2, 128, torch.bfloat16))
    cos, sin = (t.cuda() for t in trig(1, 1031, 128, torch.bfloat16))
    leaves = [t.clone().requires_grad_() for t in (q, k, q, k)]
    expected, got = rope_reference(leaves[0], leaves[1], cos, sin), kernel(leaves[2], leaves[3], cos, sin)
    grads = [torch.randn_like(t) for t in expected]
    torch.autograd.backward(expected, grads)
    torch.autograd.backward(got, grads)
    for want, have in zip((*expected, leaves[0].grad, leaves[1].grad), (*got, leaves[2].grad, leaves[3].grad),
                          strict=True):  # fmt: skip
        assert torch.equal(have, want)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 13, 14, 15, 16, 17, 18, 19]], device="cuda")
    plain, fast = tiny("qwen2", torch.bfloat16).cuda().train(), tiny("qwen2", torch.bfloat16).cuda().train()
    enable_fast_lora(plain, norms=False, attention=False)
    enable_fast_lora(fast, norms=False)
    want, have = step(plain, ids, (ids != 0).long()), step(fast, ids, (ids != 0).long())
    assert torch.equal(have[0], want[0]) and all(torch.equal(have[1][n], g) for n, g in want[1].items())


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_reference_has_autograds_bits(dtype):
    """`rope_backward_reference` (the fused q/k/v Function's rotation backward off the kernels) is autograd's backward
    of `rope_reference`, bit for bit."""
    from slimrl.ops.rope import rope_backward_reference

    q, k = qk(2, 5, 3, 1, 16, dtype)
    cos, sin = trig(2, 5, 16, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(t.shape, generator=g).to(dtype) for t in (q, k)]
    torch.autograd.backward(rope_reference(*leaves, cos, sin), grads)
    got = rope_backward_reference(*grads, cos, sin)
    assert torch.equal(got[0], leaves[0].grad) and torch.equal(got[1], leaves[1].grad)
