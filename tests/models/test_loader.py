"""FastLanguageModel.from_pretrained: dtype and device choice, the pad-token rule, recorded options, bad input."""

from __future__ import annotations

import pytest
import torch

from slimrl import FastLanguageModel
from slimrl.models import loader
from slimrl.models.loader import LoadOptions
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.models.helpers import CONTEXT, save_tiny


@pytest.fixture
def saved_tiny(tmp_path, arch):
    return save_tiny(tmp_path / f"tiny-{arch}", arch)


def fake_hardware(monkeypatch, cuda: bool, bf16: bool = False):
    monkeypatch.setattr(loader, "cuda_available", lambda: cuda)
    monkeypatch.setattr(loader, "bf16_supported", lambda: bf16)


# -- dtype and device ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cuda,bf16,expected",
    [(False, False, torch.float32), (True, True, torch.bfloat16), (True, False, torch.float16)],
    ids=["cpu-fp32", "bf16-gpu", "older-gpu-fp16"],
)
def test_default_dtype_follows_the_hardware(monkeypatch, cuda, bf16, expected):
    fake_hardware(monkeypatch, cuda, bf16)
    assert loader.choose_dtype(None) == expected
    assert loader.choose_dtype("auto") == expected


@pytest.mark.parametrize(
    "given,expected",
    [(torch.float16, torch.float16), ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
     ("float32", torch.float32), ("fp32", torch.float32)],
)  # fmt: skip
def test_explicit_dtype_is_honoured_whatever_the_hardware(monkeypatch, given, expected):
    fake_hardware(monkeypatch, cuda=True, bf16=True)
    assert loader.choose_dtype(given) == expected


def test_unknown_dtype_is_an_error_that_lists_the_choices():
    with pytest.raises(ValueError, match="Unknown dtype 'float13'; use torch.bfloat16"):
        loader.choose_dtype("float13")


def test_explicit_dtype_reaches_the_weights(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny), dtype="bfloat16", max_seq_length=CONTEXT)
    assert model.dtype == torch.bfloat16 and model.slimrl_options.dtype == torch.bfloat16


def test_device_map_is_the_single_gpu_or_the_cpu(monkeypatch):
    fake_hardware(monkeypatch, cuda=False)
    assert loader.default_device_map() == {"": "cpu"}
    fake_hardware(monkeypatch, cuda=True)
    monkeypatch.setenv("LOCAL_RANK", "3")  # one process per GPU under torchrun / accelerate
    assert loader.default_device_map() == {"": 3}


def test_cpu_load_puts_every_weight_on_the_cpu(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(str(saved_tiny), max_seq_length=CONTEXT)
    assert {p.device.type for p in model.parameters()} == {"cpu"}


# -- tokenizer -------------------------------------------------------------------------------------------------------


def tokenizer_with(vocab: dict, **specials):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab, unk_token=specials.get("unk_token")))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


def test_pad_token_equal_to_eos_is_replaced_by_an_unused_special_token():
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token  # what many checkpoints ship
    loader.ensure_pad_token(tokenizer)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_pad_token_prefers_llama3_reserved_pad_and_never_any_end_token():
    vocab = {"a": 0, "<|end_of_text|>": 1, "<|eot_id|>": 2, "<|finetune_right_pad_id|>": 3, "<pad>": 4}
    tokenizer = tokenizer_with(vocab, eos_token="<|end_of_text|>")
    loader.ensure_pad_token(tokenizer)
    assert tokenizer.pad_token == "<|finetune_right_pad_id|>"

    # Llama 3 Instruct ends turns with <|eot_id|>, an end token of generation but not the tokenizer's EOS
    model = tiny_model(vocab_size=5)
    model.generation_config.eos_token_id = [1, 2]
    tokenizer = tokenizer_with({k: v for k, v in vocab.items() if v != 3}, eos_token="<|end_of_text|>")
    tokenizer.pad_token = "<|eot_id|>"
    loader.ensure_pad_token(tokenizer, model)
    assert tokenizer.pad_token == "<pad>" and model.generation_config.pad_token_id == 4


def test_pad_token_falls_back_to_unk_before_adding_a_token():
    tokenizer = tokenizer_with({"a": 0, "<unk>": 1, "</s>": 2}, eos_token="</s>", unk_token="<unk>")
    model = tiny_model(vocab_size=3)
    loader.ensure_pad_token(tokenizer, model)
    assert tokenizer.pad_token == "<unk>" and model.get_input_embeddings().weight.shape[0] == 3


def test_pad_token_added_and_embeddings_resized_when_no_candidate():
    tokenizer = tokenizer_with({"a": 0, "b": 1, "</s>": 2}, eos_token="</s>")
    model = tiny_model(vocab_size=3)
    loader.ensure_pad_token(tokenizer, model)
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id == 3
    assert model.get_input_embeddings().weight.shape[0] == 4 and model.config.pad_token_id == 3
    assert model.generation_config.pad_token_id == 3 and tokenizer.padding_side == "left"


def test_loaded_tokenizer_pads_left_and_keeps_its_chat_template(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "right"
    path = save_tiny(tmp_path / "tiny", tokenizer=tokenizer)
    model, loaded = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
    assert loaded.padding_side == "left" and loaded.chat_template == tokenizer.chat_template
    assert model.slimrl_tokenizer is loaded


# -- recorded options and bad input ----------------------------------------------------------------------------------


def test_load_options_are_recorded_on_the_model_and_read_through_the_adapter(saved_tiny):
    model, _ = FastLanguageModel.from_pretrained(
        str(saved_tiny), max_seq_length=128, fast_inference=True, gpu_memory_utilization=0.7, max_lora_rank=32
    )
    expected = LoadOptions(max_seq_length=128, dtype=torch.float32, fast_inference=True, gpu_memory_utilization=0.7,
                           max_lora_rank=32)  # fmt: skip
    assert model.slimrl_options == expected and model.max_seq_length == 128
    peft_model = FastLanguageModel.get_peft_model(model, r=8)
    assert peft_model.slimrl_options is model.slimrl_options
    assert peft_model.slimrl_options.gradient_checkpointing is True


def test_a_loaded_model_saves_to_gguf_before_any_adapter(saved_tiny, tmp_path):
    from gguf import GGUFReader

    model, tokenizer = FastLanguageModel.from_pretrained(str(saved_tiny), max_seq_length=128)
    path = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="f16")
    reader = GGUFReader(str(path))
    names = {tensor.name for tensor in reader.tensors}
    assert "token_embd.weight" in names and any(name.startswith("blk.0.") for name in names)


def test_max_seq_length_beyond_the_context_warns_that_rope_is_not_scaled(saved_tiny):
    with pytest.warns(UserWarning, match=r"max_seq_length=4096 exceeds .*=512.*does not extend RoPE"):
        FastLanguageModel.from_pretrained(str(saved_tiny), max_seq_length=4096)


@pytest.mark.parametrize(
    "bad,message",
    [({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
     ({"max_seq_length": 0}, "max_seq_length must be a positive integer"),
     ({"max_lora_rank": -1}, "max_lora_rank must be a positive integer")],
)  # fmt: skip
def test_bad_load_options_are_refused_before_loading(bad, message):
    with pytest.raises(ValueError, match=message):
        FastLanguageModel.from_pretrained("/never/looked/at", **bad)
