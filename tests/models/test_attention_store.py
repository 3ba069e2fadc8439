"""The attention kept from the offloaded checkpoints' forward (`models.attention_store`): a tiny Llama and Qwen2 with
fast LoRA and MLP tiles give bit for bit the loss, logits and LoRA gradients of the plain recompute, with the padded
batch's mask and without a mask, while the attention function runs once per layer instead of twice; everything it
parked is gone after the backward; under the threshold nothing is kept; on CUDA the pinned side-stream copies give
the same bits in bf16.

On the CPU the training kernels (RMSNorm, rotary embedding, gated product) take their PyTorch references here, not
Triton's interpreter: what is tested is where attention is stored and replayed, which the kernels do not touch
(tests/ops/test_fast_lora.py runs them interpreted under the offloaded checkpoints; the CUDA case runs them compiled),
and the interpreter made this file the slowest of the suite."""

from __future__ import annotations

import gc

import pytest
import torch

from slimrl.models import attention_store
from slimrl.models.checkpointing import enable_offloaded_checkpointing
from slimrl.models.fast_lora import enable_fast_lora
from tests.ops.test_fast_lora import lora_model


@pytest.fixture(autouse=True)
def eager_training_kernels_on_the_cpu(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # `ops.kernels.runs_here` is then False for CPU tensors


PADDED = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 13, 14, 15, 16, 17, 18, 19]])
FULL = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 13, 14, 15, 16, 17, 18, 19]])


def run(model, ids: torch.Tensor):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=(ids != 0).long(), labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def assert_equal(expected, actual):
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert expected[2].keys() == actual[2].keys() and expected[2]
    for name, grad in expected[2].items():
        assert torch.equal(actual[2][name], grad), name


def counting_attention_calls(monkeypatch) -> list:
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or original(*a, **k))  # fmt: skip
    return calls


def parked_storages() -> int:
    """Saved storages still held (parked ones, and those left in place)."""
    return sum(isinstance(o, attention_store._Parked | attention_store._Resident) for o in gc.get_objects())


@pytest.mark.parametrize("ids", [PADDED, FULL], ids=["padded", "unpadded"])
def test_kept_attention_gives_the_recomputes_bits_with_one_attention_call_per_layer(arch, ids, monkeypatch):
    model = lora_model(arch)
    enable_fast_lora(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=4, min_offload_bytes=0)
    calls = counting_attention_calls(monkeypatch)
    plain = run(model, ids)
    assert len(calls) == 4 and state.kept_attention == 0  # 2 layers, each in the forward and again in the recompute
    calls.clear()
    state.attention_tokens = ids.shape[1]
    kept = run(model, ids)
    assert len(calls) == 2 and state.kept_attention == 2  # the recompute took both layers' stored attention
    assert_equal(plain, kept)
    gc.collect()
    assert parked_storages() == 0  # the stored graphs and their host copies went with the backward
    state.attention_tokens = ids.shape[1] + 1  # sequences shorter than the threshold recompute as before
    calls.clear()
    assert_equal(plain, run(model, ids))
    assert len(calls) == 4 and state.kept_attention == 2


def test_q_k_and_v_are_read_from_the_recompute_not_parked(monkeypatch):
    model = lora_model()
    enable_fast_lora(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=4, min_offload_bytes=0, attention_tokens=1)
    made, parked = [], []
    original_input, original_parked = attention_store._Input.__init__, attention_store._Parked.__init__
    monkeypatch.setattr(attention_store._Input, "__init__", lambda self, r, i, t: made.append(i) or
                        original_input(self, r, i, t))  # fmt: skip
    monkeypatch.setattr(attention_store._Parked, "__init__", lambda self, st, t: parked.append(t.shape) or
                        original_parked(self, st, t))  # fmt: skip
    kept = run(model, FULL)
    assert state.kept_attention == 2
    assert sorted(set(made)) == [0, 1, 2]  # each layer's graph read its q, k and v from the recompute
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    assert kv_heads < heads  # grouped K/V: their shapes differ from the output's
    # per layer: the output and its log-sum-exp parked, nothing else (q, k and v were parked too before)
    assert sorted(tuple(shape) for shape in parked) == [(2, heads, 9)] * 2 + [(2, heads, 9, head_dim)] * 2
    state.attention_tokens = 0
    assert_equal(run(model, FULL), kept)


def test_a_recompute_laid_out_unlike_the_forward_is_refused():
    q = torch.randn(1, 2, 3, 4)
    record = attention_store.AttentionRecord(None, [], (q, q[:, :1], q[:, 1:]))
    twin = q.clone()
    record.take_inputs((twin, twin[:, :1], twin[:, 1:]))  # another storage, the same layouts: taken
    with pytest.raises(RuntimeError, match="laid out unlike the forward"):
        record.take_inputs((q, q[:, :1].clone(), q[:, 1:]))  # k in a storage of its own


def test_small_tensors_stay_in_place_and_a_recompute_without_a_record_computes_attention(monkeypatch):
    model = lora_model()
    enable_fast_lora(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=0, attention_tokens=1)  # all under 1 MiB: none parked
    made = []
    original = attention_store._Parked.__init__
    monkeypatch.setattr(attention_store._Parked, "__init__", lambda self, *a: made.append(1) or original(self, *a))
    kept = run(model, PADDED)
    assert state.kept_attention == 2 and not made
    state.attention_tokens = 0
    assert_equal(run(model, PADDED), kept)
    with attention_store.replaying(attention_store.deque()):  # nothing stored: the function runs
        query = torch.randn(1, 2, 3, 4)
        out, _ = attention_store.attention(lambda m, q, k, v, mask, **kw: (q * 2, None), None, query, query, query,
                                           None)  # fmt: skip
    assert torch.equal(out, query * 2)


def test_records_let_go_without_a_backward_free_what_they_saved():
    """A layer graph's capture releases its record without a backward (no engine frees its graph's saved tensors):
    what it kept in place, the attention's own output and log-sum-exp among them, must not stay alive through the
    record's graph (a saved output holds its node, which holds what the hooks packed)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attn = lora_model().base_model.model.model.layers[0].self_attn
    query, key = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8)

    class State:
        min_offload_bytes = 1 << 30  # everything stays in place

    kept = attention_store.deque()
    with attention_store.capturing(State()) as captured:
        attention_store.attention(sdpa_attention_forward, attn, query, key, key, None, dropout=0.0, scaling=0.3,
                                  is_causal=True)  # fmt: skip
    with attention_store.recording(State(), kept):
        attention_store.attention(sdpa_attention_forward, attn, query, key, key, None, dropout=0.0, scaling=0.3,
                                  is_causal=True)  # fmt: skip
    assert len(captured) == len(kept) == 1 and parked_storages() >= 4
    for record in (*captured, *kept):
        record.release()
    del captured, kept
    gc.collect()
    assert parked_storages() == 0


def test_bad_threshold_is_refused():
    with pytest.raises(ValueError, match="attention_tokens must be >= 0"):
        enable_offloaded_checkpointing(lora_model(), attention_tokens=-1)


@pytest.mark.cuda  # pinned host copies on the side stream, cuDNN/flash SDPA in bf16
@pytest.mark.parametrize("ids", [PADDED, FULL], ids=["padded", "unpadded"])
def test_kept_attention_on_cuda_in_bf16_gives_the_recomputes_bits(ids):
    model = lora_model("qwen2", dtype=torch.bfloat16).cuda()
    enable_fast_lora(model)
    state = enable_offloaded_checkpointing(model, mlp_tile_tokens=4, min_offload_bytes=0)
    ids = ids.cuda()
    plain = run(model, ids)
    state.attention_tokens = 1
    kept = run(model, ids)
    assert state.kept_attention == 2 and state.offloaded == 4
    assert_equal(plain, kept)


def test_the_demo_passes_its_setting_to_the_trainer_config(tmp_path):
    from slimrl.cli.demo import DemoSettings
    from slimrl.cli.demo_algorithms import grpo_config_kwargs
    from slimrl.trainers.grpo.config import GRPOConfig

    assert GRPOConfig(**grpo_config_kwargs(DemoSettings(), tmp_path, "cpu")).keep_attention_tokens == 4096
    chosen = GRPOConfig(**grpo_config_kwargs(DemoSettings(keep_attention_tokens=1), tmp_path, "cpu"))
    assert chosen.keep_attention_tokens == 1
    # the layer graphs' switch the same way (on by default)
    assert GRPOConfig(**grpo_config_kwargs(DemoSettings(), tmp_path, "cpu")).layer_cuda_graphs
    off = GRPOConfig(**grpo_config_kwargs(DemoSettings(layer_cuda_graphs=False), tmp_path, "cpu"))
    assert not off.layer_cuda_graphs
