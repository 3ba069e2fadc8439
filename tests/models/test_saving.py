"""Saving: the adapter reloads to identical logits, the merged model is plain transformers and decodes the same, and
no save overwrites or corrupts anything it should not."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimrl import FastLanguageModel
from slimrl.models.saving import MARKER
from tests.models.helpers import CONTEXT, greedy, logits, save_tiny
from tests.tolerances import assert_close


@pytest.fixture
def base_path(tmp_path, arch):
    return save_tiny(tmp_path / f"tiny-{arch}", arch)


def adapted(path, **peft_kwargs):
    """A LoRA model whose adapter changes the output (B is not zero), as after training."""
    model, tokenizer = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
    model = FastLanguageModel.get_peft_model(model, r=4, init_lora_weights=False, **peft_kwargs)
    return FastLanguageModel.for_inference(model), tokenizer


def test_saved_adapter_reloads_on_a_fresh_base_to_identical_logits(base_path, tmp_path):
    from peft import PeftModel

    model, tokenizer = adapted(base_path)
    FastLanguageModel.save_lora(model, tokenizer, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), tmp_path / "adapter").eval()
    assert torch.equal(logits(reloaded), logits(model))
    assert AutoTokenizer.from_pretrained(tmp_path / "adapter").chat_template == tokenizer.chat_template


def test_merged_save_loads_in_transformers_and_decodes_the_same_greedy_text(base_path, tmp_path):
    model, tokenizer = adapted(base_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_32bit")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the live model is untouched
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not hasattr(merged, "peft_config") and merged.dtype == torch.float32
    assert_close(logits(merged), logits(model), name="merged logits")
    assert torch.equal(greedy(merged, 12), greedy(model, 12))
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").chat_template == tokenizer.chat_template


def test_merged_16bit_save_is_fp16_and_close_to_the_adapter_model(base_path, tmp_path):
    model, tokenizer = adapted(base_path)
    model.save_pretrained_merged(tmp_path / "merged16", tokenizer)  # fp32 training model: fp16 by default
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged16").dtype == torch.float16
    # computed in fp32, the stored weights differ from the adapter model's only by their rounding to fp16
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged16", dtype=torch.float32)
    assert_close(logits(merged), logits(model), "fp16", name="fp16 merged logits")
    bf16 = FastLanguageModel.save_merged(model, tokenizer, tmp_path / "merged-bf16", dtype="bfloat16")
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        FastLanguageModel.save_merged(model, tokenizer, tmp_path / "merged-int8", dtype=torch.int8)


def test_merged_save_of_tied_embeddings_and_modules_to_save(tmp_path):
    """Qwen2.5-style tied embeddings, and a fully trained module (modules_to_save) whose trained copy is saved."""
    path = save_tiny(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    model, tokenizer = adapted(path, modules_to_save=["norm"])
    with torch.no_grad():
        model.base_model.model.model.norm.modules_to_save["default"].weight.mul_(1.5)  # "trained"
    FastLanguageModel.save_merged(model, tokenizer, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    assert_close(logits(merged), logits(model), name="merged logits (tied, modules_to_save)")


def test_unknown_save_method_and_hub_push_are_refused(base_path, tmp_path):
    model, tokenizer = adapted(base_path)
    with pytest.raises(ValueError, match=r"save_method must be one of \('lora', 'merged_16bit', 'merged_32bit'\)"):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, save_method="merged_4bit")
    with pytest.raises(NotImplementedError, match="does not push to the hub"):
        model.save_pretrained_merged(tmp_path / "x", tokenizer, push_to_hub=True)
    with pytest.raises(ValueError, match="needs a model with a LoRA adapter"):
        FastLanguageModel.save_lora(model.get_base_model(), tokenizer, tmp_path / "x")


def test_a_previous_slimrl_save_is_replaced_but_a_foreign_directory_is_not(base_path, tmp_path):
    model, tokenizer = adapted(base_path)
    target = tmp_path / "adapter"
    model.save_pretrained_merged(target, tokenizer, save_method="lora")
    assert json.loads((target / MARKER).read_text())["kind"] == "lora"
    model.save_pretrained_merged(target, tokenizer, save_method="merged_32bit")  # an earlier slimrl save: replaced
    assert json.loads((target / MARKER).read_text())["kind"] == "merged"
    assert not (target / "adapter_config.json").exists()  # nothing of the old save is left mixed in

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not an earlier slimrl save; pass overwrite=True"):
        FastLanguageModel.save_lora(model, tokenizer, foreign)
    assert (foreign / "thesis.txt").read_text() == "precious"
    FastLanguageModel.save_lora(model, tokenizer, foreign, overwrite=True)
    assert (foreign / "adapter_config.json").is_file() and not (foreign / "thesis.txt").exists()


def test_dangerous_targets_are_refused_even_with_overwrite(base_path, tmp_path, monkeypatch):
    model, tokenizer = adapted(base_path)
    monkeypatch.chdir(tmp_path)
    for target in (tmp_path, base_path):  # the working directory; the directory the model was loaded from
        with pytest.raises(ValueError, match="Refusing to save into"):
            FastLanguageModel.save_merged(model, tokenizer, target, overwrite=True)
    assert (base_path / "config.json").is_file()


def test_a_failed_save_leaves_the_previous_one_intact_and_no_debris(base_path, tmp_path, monkeypatch):
    model, tokenizer = adapted(base_path)
    target = tmp_path / "adapter"
    FastLanguageModel.save_lora(model, tokenizer, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(model), "save_pretrained", failing_save)
    with pytest.raises(OSError, match="disk full"):
        FastLanguageModel.save_lora(model, tokenizer, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
