"""Fast LoRA on a peft model (`models.fast_lora`): tiny Llama and Qwen2 give the same loss, logits and LoRA gradients
with it on as off, plain and under slimrl's offloaded checkpointing with MLP tiles (its recompute going through the
fused MLP); peft's disable_adapter() still gives the base model; it can be undone; what it cannot fuse keeps peft's
forward with the reason logged; a 4-bit base (bitsandbytes NF4 on the CPU, and on CUDA); the environment switch."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.models import fast_lora, recompute
from slimrl.models.checkpointing import enable_offloaded_checkpointing
from slimrl.models.fast_lora import (
    describe_fast_lora,
    disable_fast_lora,
    enable_fast_lora,
    is_fast_lora,
)
from slimrl.testing import tiny_model
from tests.tolerances import assert_close

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 13, 14, 15, 16, 17, 18]])
MASK = (IDS != 0).long()
SWITCHED = {"mlp": 2, "linear": 8, "norm": 4, "attention": 2}  # 2 layers: MLPs, q/k/v/o, two norms, attention blocks


def lora_model(arch="llama", dropout=0.0, dtype=torch.float32, **config):
    config = {"target_modules": "all-linear", **config}
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=dropout, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return get_peft_model(tiny_model(arch, dtype=dtype), lora)


def loss_and_grads(model):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=IDS, attention_mask=MASK, labels=IDS, use_cache=False)  # a training forward: no KV cache
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def assert_same(expected, actual, label, kind="fp32"):
    assert_close(actual[0], expected[0], kind, name=f"{label}: loss")
    assert_close(actual[1], expected[1], kind, name=f"{label}: logits")
    assert expected[2].keys() == actual[2].keys() and expected[2]
    for name, grad in expected[2].items():
        scale = grad.abs().max()  # gradients relative to their tensor's scale (the table's grad_fp32)
        assert_close(actual[2][name] / scale, grad / scale, "grad_fp32", name=f"{label}: grad of {name}")


def counting(monkeypatch, name):
    """Count the calls of fast_lora's `name` (lora_mlp, lora_linear, lora_qkv or rope)."""
    calls = []
    original = getattr(fast_lora, name)
    monkeypatch.setattr(fast_lora, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


def test_loss_logits_and_lora_grads_equal_with_fast_lora_on_and_off(arch, monkeypatch):
    model = lora_model(arch)
    reference = loss_and_grads(model)
    assert enable_fast_lora(model) == sum(SWITCHED.values())
    assert describe_fast_lora(model) == SWITCHED and is_fast_lora(model)
    assert enable_fast_lora(model) == 0  # idempotent
    mlp_calls, linear_calls = counting(monkeypatch, "lora_mlp"), counting(monkeypatch, "lora_linear")
    qkv_calls, rope_calls = counting(monkeypatch, "lora_qkv"), counting(monkeypatch, "rope")
    fast = loss_and_grads(model)
    # the fused Functions ran: per layer the MLP, o_proj, and q/k/v with the rotation inside
    assert (len(mlp_calls), len(linear_calls), len(qkv_calls), len(rope_calls)) == (2, 2, 2, 0)
    assert all(n.endswith("lora_A.default.weight") or n.endswith("lora_B.default.weight") for n in fast[2])
    assert_same(reference, fast, "fast LoRA")


def test_under_offloaded_checkpointing_with_mlp_tiles(arch, monkeypatch):
    model = lora_model(arch)
    reference = loss_and_grads(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=5)  # 16 tokens: tiles of at most 5, so 4 of 4
    enable_fast_lora(model)
    mlp_calls = counting(monkeypatch, "lora_mlp")
    assert_same(reference, loss_and_grads(model), "fast LoRA, offloaded")
    assert state.split_recomputes == 2 and state.offloaded == 2
    assert len(mlp_calls) == 2 * (4 + 4)  # per layer: 4 tiles in the forward, 4 again in the recompute
    # the long-sequence path of the recompute (CUDA, >= 16k tokens) calls ops.fused.mlp_forward / norm_forward,
    # which must call the switched modules' own forwards
    monkeypatch.setattr(recompute, "_use_fused", lambda hidden_states: True)
    mlp_calls.clear()
    assert_same(reference, loss_and_grads(model), "fast LoRA, offloaded, fused recompute path")
    assert len(mlp_calls) == 2 * (4 + 4)


def test_the_recompute_skips_the_mlp_output_it_never_reads(monkeypatch):
    """The recompute's MLP tiles are backward roots only: the fused MLP skips down's GEMM there, with the same
    gradients, bit for bit, as a recompute that computes it; a forward hook on the MLP gets the real output. The
    element-wise kernels take their PyTorch references here (what is tested is the recompute's choice; the Function's
    own test runs them interpreted, and on CUDA)."""
    from slimrl.ops import lora_mlp as mlp_ops

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # `ops.kernels.runs_here` is then False for CPU tensors
    model = lora_model("llama")
    enable_offloaded_checkpointing(model, mlp_tile_tokens=5)
    enable_fast_lora(model)
    read_modes = []
    original = mlp_ops.LoRAMLPFunction.apply
    monkeypatch.setattr(mlp_ops.LoRAMLPFunction, "apply",
                        lambda x, spec, *t: read_modes.append(spec.output_read) or original(x, spec, *t))  # fmt: skip
    skipped = loss_and_grads(model)
    # per layer: 4 tiles in the forward (read), 4 in the recompute (not read)
    assert read_modes == [True] * 8 + [False] * 8
    monkeypatch.setattr(recompute, "output_unread", contextlib.nullcontext)
    read_modes.clear()
    computed = loss_and_grads(model)
    assert read_modes == [True] * 16
    assert torch.equal(skipped[0], computed[0]) and skipped[2].keys() == computed[2].keys()
    for name, grad in computed[2].items():
        assert torch.equal(skipped[2][name], grad), name
    monkeypatch.undo()
    outputs = []
    mlp = model.base_model.model.model.layers[0].mlp
    mlp.register_forward_hook(lambda module, args, out: outputs.append((args[0].detach(), out.detach())))
    hooked = loss_and_grads(model)
    assert len(outputs) == 8  # 4 tiles in the forward, 4 in the recompute
    for tile, out in outputs[4:]:  # the recompute's tiles, as the hook saw them: real outputs
        with torch.no_grad():
            assert torch.equal(out, mlp(tile))
    assert torch.equal(hooked[0], computed[0])


def test_disable_adapter_falls_back_to_the_base_model_and_disable_restores_peft():
    model = lora_model()
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=IDS, attention_mask=MASK).logits
    with_lora = loss_and_grads(model)
    enable_fast_lora(model)
    with torch.no_grad(), model.disable_adapter():  # TRL's reference pass on a peft policy
        assert_close(model(input_ids=IDS, attention_mask=MASK).logits, base_logits, name="adapter disabled")
    assert disable_fast_lora(model) == sum(SWITCHED.values())
    assert not is_fast_lora(model) and describe_fast_lora(model) == dict.fromkeys(SWITCHED, 0)
    assert not any("forward" in vars(m) for m in model.modules())  # no instance forward left behind
    assert_same(with_lora, loss_and_grads(model), "after disable_fast_lora", kind="exact")


def test_what_cannot_be_fused_keeps_peft_forward_and_says_why(caplog):
    model = lora_model(dropout=0.1)
    with caplog.at_level("DEBUG", logger="slimrl.models.fast_lora"):
        switched = enable_fast_lora(model, norms=False, attention=False)
    assert switched == 0 and describe_fast_lora(model)["linear"] == 0
    assert "lora_dropout > 0" in caplog.text and "self_attn.q_proj keeps peft's forward" in caplog.text
    # only some MLP projections targeted: the MLP stays unfused, its LoRA projections and the attention's are fused
    partial = lora_model(target_modules=["q_proj", "v_proj", "gate_proj", "up_proj"])
    reference = loss_and_grads(partial)
    with caplog.at_level("DEBUG", logger="slimrl.models.fast_lora"):
        enable_fast_lora(partial)
    assert describe_fast_lora(partial) == {"mlp": 0, "linear": 8, "norm": 4, "attention": 2}
    assert "mlp stays unfused: down_proj: not a peft LoRA layer" in caplog.text
    assert_same(reference, loss_and_grads(partial), "partly fused")


def largest_relative_error(grads: dict, truth: dict) -> float:
    """The largest gradient error over all tensors, each relative to its true tensor's largest magnitude."""
    return max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in truth.items())


def test_bf16_base_with_fp32_adapters_under_autocast_is_as_accurate_as_peft(monkeypatch):
    # peft's default on a bf16 model: the adapters in fp32, the step under bf16 autocast (as the trainers run it).
    # Through two layers, attention and the loss, peft's own bf16 gradients are up to 5% of a tensor's scale off the
    # same model in fp32 (measured), so the fused path is held to peft's accuracy against that truth, not to peft.
    model = lora_model("qwen2", dtype=torch.bfloat16)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.dtype == torch.float32
    truth = loss_and_grads(copy.deepcopy(model).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = loss_and_grads(model)
        enable_fast_lora(model)
        mlp_calls = counting(monkeypatch, "lora_mlp")
        fast = loss_and_grads(model)
    assert len(mlp_calls) == 2  # the fused MLP ran under autocast
    assert all(g.dtype == torch.float32 for g in fast[2].values()) and fast[2].keys() == truth[2].keys()
    assert_close(fast[0], truth[0], "bf16", name="loss")
    peft_error, fast_error = largest_relative_error(reference[2], truth[2]), largest_relative_error(fast[2], truth[2])
    assert fast_error <= 2 * peft_error, f"fast LoRA's bf16 gradients {fast_error:.3g} off, peft's {peft_error:.3g}"


def test_4bit_base_through_bitsandbytes_on_the_cpu(tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from slimrl import FastLanguageModel
    from tests.models.helpers import CONTEXT, save_tiny

    path = save_tiny(tmp_path / "tiny")
    model, _ = FastLanguageModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=CONTEXT)
    model = FastLanguageModel.get_peft_model(model, r=4, init_lora_weights=False)
    reference = loss_and_grads(model)
    enable_fast_lora(model)
    assert describe_fast_lora(model) == SWITCHED  # Linear4bit bases fused, dequantised inside the Functions
    mlp_calls, linear_calls = counting(monkeypatch, "lora_mlp"), counting(monkeypatch, "lora_linear")
    qkv_calls = counting(monkeypatch, "lora_qkv")
    fast = loss_and_grads(model)
    # each in the forward and again in the recompute of the gradient checkpointing get_peft_model turns on
    assert (len(mlp_calls), len(linear_calls), len(qkv_calls)) == (4, 4, 4)
    # both dequantise the same NF4 weights; bitsandbytes' CPU matmul sums in another order
    assert_same(reference, fast, "4-bit base", kind="fp32_sum")


@pytest.mark.cuda
def test_4bit_base_on_cuda(tmp_path):
    # bitsandbytes' CUDA NF4 weights through the dequantize hook, the gated product and norms compiled by Triton;
    # fp32 compute, so the two paths differ only in summation order
    pytest.importorskip("bitsandbytes")
    from slimrl import FastLanguageModel
    from tests.models.helpers import CONTEXT, save_tiny

    path = save_tiny(tmp_path / "tiny")
    model, _ = FastLanguageModel.from_pretrained(str(path), load_in_4bit=True, dtype="float32", max_seq_length=CONTEXT)
    model = FastLanguageModel.get_peft_model(model, r=4, init_lora_weights=False)
    assert next(model.parameters()).is_cuda
    global IDS, MASK
    ids, mask = IDS, MASK
    try:
        IDS, MASK = ids.cuda(), mask.cuda()
        reference = loss_and_grads(model)
        enable_fast_lora(model)
        fast = loss_and_grads(model)
    finally:
        IDS, MASK = ids, mask
    assert describe_fast_lora(model) == SWITCHED
    assert_same(reference, fast, "4-bit base on CUDA", kind="fp32_sum")


def test_disable_one_kind_only():
    model = lora_model()
    enable_fast_lora(model)
    assert disable_fast_lora(model, kind="attention") == 2
    assert describe_fast_lora(model) == {**SWITCHED, "attention": 0}
    with pytest.raises(ValueError, match="kind must be one of"):
        disable_fast_lora(model, kind="rope")
    assert enable_fast_lora(model) == 2  # only the attention blocks again
