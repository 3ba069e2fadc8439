"""Phi-3 through the engine's one forward: q/k/v and gate/up are row views of the fused qkv_proj and gate_up_proj,
with peft's LoRA on the fused layers as a whole (fp32, tiny random model)."""

from __future__ import annotations

import pytest
import torch

from slimrl.rollout.engine import RolloutEngine
from slimrl.rollout.model.llama import Decoder
from slimrl.rollout.model.reference import apply_linear
from slimrl.rollout.model.views import FusedRows, layer_modules, linear_spec, supports
from tests.rollout.helpers import (
    GREEDY,
    KERNEL_DEVICE,
    PROMPTS,
    assert_greedy_matches_generate,
    build,
    hf_greedy,
    no_eos,
    prefill_logits,
    step_the_adapter,
    with_lora,
)
from tests.tolerances import assert_close


def first_layer(model):
    return model.base_model.model.model.layers[0]


def test_slices_are_live_row_views_of_the_fused_modules_and_give_their_output_split():
    model = with_lora(build("phi3"))
    layer = first_layer(model)
    modules = layer_modules(layer)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for fused, parts in ((layer.self_attn.qkv_proj, (modules.q, modules.k, modules.v)),
                         (layer.mlp.gate_up_proj, (modules.gate, modules.up))):  # fmt: skip
        lora_a, lora_b = fused.lora_A["default"].weight, fused.lora_B["default"].weight
        specs = [linear_spec(part) for part in parts]
        for spec in specs:  # views of the live tensors, not copies: an optimizer step is seen as it happens
            assert spec.module is None and spec.weight._base is fused.base_layer.weight
            ((a, b, scale),) = spec.loras
            assert a is lora_a and b._base is lora_b and scale == fused.scaling["default"]
        with torch.no_grad():
            ours = torch.cat([apply_linear(x, spec) for spec in specs], dim=-1)
            assert_close(ours, fused(x), "fp32", name="slices against the fused peft module")
    fingerprint = Decoder(model).fingerprint()
    assert len({fingerprint[2], fingerprint[3], fingerprint[4]}) == 3, "q, k and v are told apart"
    assert fingerprint == Decoder(model).fingerprint()


def test_greedy_with_lora_on_the_fused_layers_matches_generate():
    model = with_lora(no_eos(build("phi3")))
    assert {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"} <= {
        name.split(".")[-4] for name, _ in model.named_parameters() if "lora_B" in name
    }
    assert_greedy_matches_generate(model)


def test_an_optimizer_step_on_the_fused_adapters_reaches_the_next_rollout():
    model = with_lora(no_eos(build("phi3")))
    engine = RolloutEngine(model)
    before = engine.generate(PROMPTS, GREEDY, max_new_tokens=10).completion_ids
    # only the fused layers' adapters move
    step_the_adapter(model, lr=50.0, keep=lambda name: "qkv_proj" in name or "gate_up_proj" in name)
    after = engine.generate(PROMPTS, GREEDY, max_new_tokens=10).completion_ids
    assert after == hf_greedy(model, PROMPTS, 10, eos_token_id=None)
    assert after != before


def test_a_fused_module_that_must_be_called_is_called_once_per_forward():
    # DoRA is applied by calling peft's module (as a 4-bit base would be): the slices share one call and split it
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, target_modules=["qkv_proj", "gate_up_proj"], use_dora=True, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = get_peft_model(build("phi3"), config).eval()
    decoder = Decoder(model)
    assert isinstance(decoder.layers[0].q, FusedRows) and linear_spec(decoder.layers[0].q).module is not None
    calls = []
    for layer in model.base_model.model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            module.register_forward_hook(lambda *args, _calls=calls: _calls.append(1))
    ids = torch.tensor([[5, 9, 11, 4, 7, 8, 13]])
    ours = prefill_logits(decoder, ids)[0]
    assert len(calls) == 2 * decoder.num_layers, "each fused module ran once, not once per slice"
    with torch.no_grad():
        theirs = model(input_ids=ids).logits[0]
    assert_close(ours, theirs, "fp32_sum", name="phi3 logits through called DoRA modules")


def test_fused_decode_kernels_take_the_slices_as_they_take_q_k_v(monkeypatch):
    # the kernels of CUDA's decode step (Triton's interpreter on a CPU) get the row views as separate projections
    from peft import LoraConfig, get_peft_model

    from slimrl.rollout.kernels import projections
    from slimrl.rollout.sampling import SamplingParams

    launches = []
    original = projections.qkv_rope_cache
    monkeypatch.setattr(projections, "qkv_rope_cache", lambda *a, **k: launches.append(1) or original(*a, **k))
    model = build("phi3", num_attention_heads=2, num_key_value_heads=1)  # head dim 32: the kernels' least
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model = model.eval().to(KERNEL_DEVICE)
    engine = RolloutEngine(model, max_seq_len=64, triton_lora=True, triton_attention=True, fused_decode=True)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, ignore_eos=True), max_new_tokens=3)
    assert launches and (KERNEL_DEVICE != "cpu" or len(launches) == 2 * 2), "each decode step's layers ran the kernel"
    for prompt, completion in zip(PROMPTS, out.completion_ids, strict=True):
        ids = torch.tensor([prompt], device=KERNEL_DEVICE)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert completion == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("rope", "words"), [
    ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 256}, "'longrope' depends on the sequence length"),
])  # fmt: skip
def test_rope_the_engine_cannot_run_is_refused_up_front(rope, words):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, sliding_window=None, rope_parameters=rope, pad_token_id=0,
                        eos_token_id=3, bos_token_id=None)  # fmt: skip
    supported, why = supports(Phi3ForCausalLM(config))
    assert not supported and words in why
