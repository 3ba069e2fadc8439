"""4-bit (NF4) and 8-bit loading through bitsandbytes, on the CPU (bitsandbytes 0.50 runs both there)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimrl import FastLanguageModel
from slimrl.models import quantization
from slimrl.testing import tiny_model
from tests.models.helpers import CONTEXT, PROMPT, PROMPT_MASK, logits, save_tiny, write_tiny_gguf
from tests.tolerances import assert_close


@pytest.fixture
def saved_tiny(tmp_path, arch):
    return save_tiny(tmp_path / f"tiny-{arch}", arch)


def test_4bit_and_8bit_together_is_an_error(saved_tiny):
    with pytest.raises(ValueError, match="exclusive"):
        FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True, load_in_8bit=True)


@pytest.mark.parametrize("bits", ["load_in_4bit", "load_in_8bit"])
def test_missing_bitsandbytes_names_the_extra_and_never_loads_full_precision(saved_tiny, monkeypatch, bits):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(ImportError, match=r"pip install 'slimrl\[gpu\]'.*never falls back"):
        FastLanguageModel.from_pretrained(str(saved_tiny), max_seq_length=CONTEXT, **{bits: True})


def test_4bit_load_is_nf4_with_double_quantisation_and_says_it_runs_on_cpu(saved_tiny, caplog):
    with caplog.at_level("WARNING", logger="slimrl.models.loader"):
        model, _ = FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True, max_seq_length=CONTEXT)
    assert "4-bit weights on the CPU" in caplog.text
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear4bit" and type(model.lm_head).__name__ == "Linear"
    state = q_proj.weight.quant_state
    assert state.quant_type == "nf4" and state.nested and q_proj.compute_dtype == torch.float32
    assert model.slimrl_options.load_in_4bit and model.is_loaded_in_4bit


def test_4bit_model_trains_a_lora_step_on_cpu_and_its_merged_save_matches(saved_tiny, tmp_path):
    model, tokenizer = FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True, max_seq_length=CONTEXT)
    model = FastLanguageModel.get_peft_model(model, r=4, init_lora_weights=False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = model(input_ids=PROMPT, attention_mask=PROMPT_MASK, labels=PROMPT).loss
    loss.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert torch.isfinite(loss) and lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    optimizer.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)  # base unchanged

    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_32bit")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not hasattr(merged.config, "quantization_config")
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    FastLanguageModel.for_inference(model)
    # the merged weights are the dequantised NF4 weights plus the trained delta: what the 4-bit layers compute with
    assert_close(logits(merged), logits(model), "nf4", name="4-bit merged logits")


def test_kbit_preparation_does_not_upcast_the_unquantised_weights(tmp_path):
    """peft's prepare_model_for_kbit_training would make the bf16 embeddings and LM head fp32; slimrl keeps them."""
    path = save_tiny(tmp_path / "tiny")
    model, _ = FastLanguageModel.from_pretrained(str(path), load_in_4bit=True, dtype="bfloat16", max_seq_length=CONTEXT)
    model = FastLanguageModel.get_peft_model(model, r=4)
    base = model.get_base_model()
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16 and base.lm_head.weight.dtype == torch.bfloat16
    assert base.model.norm.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_8bit_load_on_cpu_dequantises_to_the_original_weights(tmp_path):
    path = save_tiny(tmp_path / "tiny")
    model, _ = FastLanguageModel.from_pretrained(str(path), load_in_8bit=True, max_seq_length=CONTEXT)
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == "Linear8bitLt" and layer.weight.dtype == torch.int8
    original = tiny_model("llama").model.layers[0].self_attn.q_proj.weight.detach()
    # LLM.int8(): one absmax scale per row, so each weight is within half a step (row max / 127 / 2) of the original,
    # plus its rounding to fp16 (bitsandbytes quantises the fp16 copy)
    bound = original.abs().amax(dim=1, keepdim=True) / 254 + original.abs() * 2**-11
    for when in ("before the first forward", "after it (the scales move to the layer state)"):
        error = (quantization.dequantized_weight(layer) - original).abs()
        assert (error <= bound).all(), when
        logits(model)


def test_gguf_with_4bit_is_converted_then_quantised(tmp_path, caplog):
    """transformers refuses GGUF plus bitsandbytes; slimrl goes through a temporary plain checkpoint instead."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    with caplog.at_level("WARNING", logger="slimrl.models.loader"):
        model, tokenizer = FastLanguageModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=CONTEXT)
    assert "converting it to a temporary checkpoint" in caplog.text
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    assert "<|im_start|>" in tokenizer.chat_template
    # the loaded NF4 weight is exactly bitsandbytes' quantisation of the GGUF's weight
    import bitsandbytes

    layer = model.model.layers[0].mlp.down_proj
    weight = tiny_model("llama").model.layers[0].mlp.down_proj.weight.detach()
    packed, state = bitsandbytes.functional.quantize_4bit(
        weight, blocksize=layer.weight.quant_state.blocksize, compress_statistics=True, quant_type="nf4"
    )
    assert torch.equal(quantization.dequantized_weight(layer), bitsandbytes.functional.dequantize_4bit(packed, state))


def test_dequantized_weight_of_a_plain_linear_is_its_weight():
    linear = torch.nn.Linear(4, 3)
    assert torch.equal(quantization.dequantized_weight(linear), linear.weight.detach())


def test_a_4bit_models_state_is_the_loaded_one_after_inference_on_any_cpu(saved_tiny):
    # bitsandbytes repacks 4-bit weights for its bf16 kernel on CPUs with AVX512-BF16 (keep_cpu_4bit_layout)
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True, max_seq_length=CONTEXT)
    loaded = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        model(PROMPT, attention_mask=PROMPT_MASK)
    after = model.state_dict()
    assert set(after) == set(loaded) and any(name.endswith("bitsandbytes__nf4") for name in after)
    changed = [name for name, tensor in loaded.items() if not torch.equal(after[name], tensor)]
    assert changed == []
