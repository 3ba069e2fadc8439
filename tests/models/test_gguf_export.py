"""GGUF export: the file reloads in transformers' GGUF loader as the merged model (weights rounded exactly as the
method rounds them, logits within its tolerance) with the same tokenizer and chat template; what it cannot write is
refused before anything is written; an export never changes the live model or an earlier file."""

from __future__ import annotations

import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import slimrl
from slimrl import FastLanguageModel, NonFiniteError
from slimrl.models import gguf_export
from slimrl.models.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT
from slimrl.models.saving import merged_state_dict
from slimrl.testing import CHATML_TEMPLATE, tiny_config, tiny_model
from tests.models.helpers import CONTEXT, logits, save_tiny
from tests.tolerances import assert_close

METHODS = ["f16", "bf16", "q8_0"]
TEXT = "Héllo, wörld! 12+34=?\n<|im_start|>user\nhi<|im_end|>"
CHAT = [{"role": "user", "content": "What is 2+3?"}]
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings", "pad_token_id", "eos_token_id",
         "tie_word_embeddings")  # fmt: skip


def tiny(arch: str, seed: int = 0, **overrides):
    """slimrl.testing's tiny shapes, for Qwen3 and Mistral too. Qwen3 keeps its class's head_dim (128), which is what
    transformers' GGUF loader assumes for qwen3 files (it reads no head size for them)."""
    if arch in ("llama", "qwen2"):
        return tiny_model(arch, seed=seed, **overrides)
    from transformers import MistralConfig, Qwen3Config

    shape = tiny_config("llama", **overrides).to_dict()
    config = {"qwen3": Qwen3Config, "mistral": MistralConfig}[arch](**{k: shape[k] for k in SHAPE})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def adapted(base, seed: int = 0):
    """get_peft_model's LoRA with B drawn from N(0, 0.02^2): the adapter changes the output, as after training."""
    model = FastLanguageModel.get_peft_model(base, r=4, random_state=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return FastLanguageModel.for_inference(model)


def reload(path: str):
    folder, name = str(path).rsplit("/", 1)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def rounded_as(method: str, weight: torch.Tensor) -> torch.Tensor:
    """What a method stores for a 2-D weight (norms and biases stay fp32)."""
    if weight.dim() == 1:
        return weight
    if method == "q8_0":
        blocks = gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
        return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    return weight.to(torch.float16 if method == "f16" else torch.bfloat16).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_each_method_reloads_as_the_merged_model(arch, tokenizer, tmp_path):
    model = adapted(tiny(arch, seed=1))
    expected = logits(model)
    with torch.no_grad():
        merged = merged_state_dict(model, torch.float32)
    base_logits = logits(tiny(arch, seed=1))
    assert (base_logits - expected).abs().max() > 0.05  # the adapter matters: exporting the base would fail below

    paths = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method=METHODS)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["model.F16.gguf", "model.BF16.gguf", "model.Q8_0.gguf"]
    for method, path in zip(METHODS, paths, strict=True):
        reloaded = reload(path)
        state = reloaded.state_dict()
        assert set(state) == set(merged), method
        for name, weight in merged.items():  # q/k rows in transformers' order again: the permutation round-trips
            assert torch.equal(state[name], rounded_as(method, weight)), f"{method} {name}"
        assert_close(logits(reloaded), expected, f"gguf_{method}", name=f"{arch} {method} logits")
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == sorted(p.rsplit("/", 1)[1] for p in paths)


def test_byte_level_tokenizer_and_chat_template_round_trip(tokenizer, tmp_path):
    model = adapted(tiny("qwen2"))
    path = slimrl.save_pretrained_gguf(model, tmp_path / "gguf", tokenizer, quantization_method="f16")
    folder, name = path.rsplit("/", 1)
    reloaded = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    assert reloaded(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template == CHATML_TEMPLATE
    assert reloaded.apply_chat_template(CHAT, add_generation_prompt=True) == tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True
    )
    assert (reloaded.eos_token, reloaded.pad_token) == (tokenizer.eos_token, tokenizer.pad_token)
    fields = gguf.GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.token_type"].contents()[:4] == [gguf.TokenType.CONTROL] * 4  # the 4 specials
    assert len(fields["tokenizer.ggml.tokens"].contents()) == model.config.vocab_size  # padded to the embedding


def byte_level_tokenizer(pre_tokenizer, byte_fallback: bool = False):
    """The tiny tokenizer's byte vocabulary plus the token "12" (one merge), splitting text with `pre_tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|im_end|>": 0, **{ch: 1 + i for i, ch in enumerate(alphabet)}, "12": 1 + len(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")], byte_fallback=byte_fallback))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")


@pytest.mark.parametrize(
    "split, name",
    [(LLAMA3_SPLIT, "llama-bpe"), (QWEN2_SPLIT, "qwen2"), ("digits", "smollm"), (None, "gpt2")],
    ids=["llama3", "qwen2", "smollm", "gpt2"],
)
def test_the_pre_tokenizer_is_named_so_that_digits_split_the_same_after_reloading(split, name, tmp_path):
    """Llama 3 splits digits in threes (so "12" merges), Qwen2 and SmolLM2 one by one (so it cannot): a file naming
    the wrong rule would reload into a tokenizer that encodes numbers differently."""
    from tokenizers import Regex, pre_tokenizers

    if split == "digits":
        pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])  # fmt: skip
    elif split is None:
        pre = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's own regex
    else:
        pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip
    tokenizer = byte_level_tokenizer(pre)
    path = slimrl.save_pretrained_gguf(tiny("llama"), tmp_path / "gguf", tokenizer, quantization_method="f16")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == name
    if name == "smollm":
        return  # llama.cpp's rule; transformers knows no such name and splits as GPT-2 (SmolLM2 has no "12" token)
    folder, file = path.rsplit("/", 1)
    reloaded = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    text = "x 123 4512, 12"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_a_byte_level_tokenizer_flagged_byte_fallback_is_still_byte_level(tmp_path):
    """transformers 5.17 reads a GGUF's byte-level vocabulary into a BPE with byte_fallback set; exporting that
    tokenizer again must still say byte-level ("gpt2"), or the file reloads as SentencePiece and splits on spaces."""
    from tokenizers import pre_tokenizers

    tokenizer = byte_level_tokenizer(pre_tokenizers.ByteLevel(add_prefix_space=False), byte_fallback=True)
    path = slimrl.save_pretrained_gguf(tiny("llama"), tmp_path / "gguf", tokenizer, quantization_method="f16")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.model"].contents() == "gpt2"
    folder, file = path.rsplit("/", 1)
    text = "What is 12 + 34?"
    assert AutoTokenizer.from_pretrained(folder, gguf_file=file)(text)["input_ids"] == tokenizer(text)["input_ids"]


def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: BPE over '▁'-prefixed pieces with byte fallback, BOS added to every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>"])}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "▁he", "▁hello", "▁w", "or", "▁wor"]:
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("ll", "o"), ("▁", "he"), ("▁he", "llo"), ("▁", "w"), ("o", "r"), ("▁w", "or")]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # fmt: skip
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


def test_sentencepiece_tokenizer_with_bos_round_trips(tmp_path):
    tokenizer = sentencepiece_tokenizer()
    model = tiny("mistral", vocab_size=288, pad_token_id=None, eos_token_id=2)
    path = slimrl.save_pretrained_gguf(model, tmp_path / "gguf", tokenizer, quantization_method="f16")
    folder, name = path.rsplit("/", 1)
    reloaded = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in ("hello world", " hello  wörld\n", "héllo"):
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 1 and reloaded(text)["input_ids"] == ids, text
        assert reloaded.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    fields = gguf.GGUFReader(path).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama" and fields["tokenizer.ggml.add_bos_token"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[:4] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE]


def test_export_leaves_the_live_model_as_it_was(tokenizer, tmp_path):
    model = adapted(tiny("llama"))
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    expected = logits(model)
    model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="q8_0")
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    assert not any(getattr(module, "merged", False) for module in model.modules())  # the adapter is not merged in
    assert torch.equal(logits(model), expected)


def test_plain_model_with_tied_embeddings_writes_no_output_tensor(tokenizer, tmp_path):
    model = tiny("qwen2", tie_word_embeddings=True)
    path = slimrl.save_pretrained_gguf(model, tmp_path / "gguf", tokenizer, quantization_method="f16")
    assert "output.weight" not in {tensor.name for tensor in gguf.GGUFReader(path).tensors}
    reloaded = reload(path)
    assert reloaded.config.tie_word_embeddings
    assert_close(logits(reloaded), logits(model), "gguf_f16", name="tied f16 logits")


def test_4bit_base_is_dequantised_before_the_merge(tmp_path, tokenizer):
    pytest.importorskip("bitsandbytes")
    path = save_tiny(tmp_path / "tiny")
    base, _ = FastLanguageModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=CONTEXT)
    model = adapted(base)
    exported = reload(model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="f16"))
    # the NF4 weights dequantised plus the LoRA delta, rounded to fp16: what the 4-bit layers compute with
    assert_close(logits(exported), logits(model), "nf4", name="4-bit base, f16 GGUF logits")


def test_llama3_rope_is_written_as_llamacpp_frequency_factors(tokenizer, tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    model = tiny("llama", rope_parameters=rope)
    path = slimrl.save_pretrained_gguf(model, tmp_path / "gguf", tokenizer, quantization_method="f16")
    factors = next(t for t in gguf.GGUFReader(path).tensors if t.name == "rope_freqs.weight").data
    head_dim = 16
    wavelengths = 2 * np.pi * 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    # wavelengths shorter than original context / high_freq_factor keep their frequency; longer than original
    # context / low_freq_factor are slowed by `factor`; the band between is interpolated
    np.testing.assert_allclose(factors[wavelengths < 64 / 4.0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(factors[wavelengths > 64 / 1.0], 8.0, rtol=1e-6)
    between = factors[(wavelengths >= 16) & (wavelengths <= 64)]
    assert ((between > 1.0) & (between < 8.0)).all()


def test_unsupported_architecture_method_and_rope_are_refused_before_writing(tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gguf"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=264, n_positions=64))
    with pytest.raises(ValueError, match=r"supports Llama, Mistral, Qwen2 and Qwen3 models; this is 'gpt2'"):
        slimrl.save_pretrained_gguf(gpt2, target, tokenizer, quantization_method="f16")
    model = adapted(tiny("llama"))
    with pytest.raises(ValueError, match=r"'q4_k_m' is not supported; GGUF export writes \['f16', 'bf16', 'q8_0'\]"):
        model.save_pretrained_gguf(target, tokenizer, quantization_method=["f16", "q4_k_m"])
    yarn = tiny("qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="RoPE of types .* this model uses 'yarn'"):
        slimrl.save_pretrained_gguf(yarn, target, tokenizer)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        model.save_pretrained_gguf(target, None)
    with pytest.raises(NotImplementedError, match="does not push to the hub"):
        model.save_pretrained_gguf(target, tokenizer, push_to_hub=True)
    assert not target.exists()


def test_missing_gguf_package_names_the_extra(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` fail
    with pytest.raises(ImportError, match=r"pip install 'slimrl\[gguf\]'"):
        slimrl.save_pretrained_gguf(tiny("llama"), tmp_path / "gguf", tokenizer)
    assert not (tmp_path / "gguf").exists()


def test_nonfinite_weights_are_refused_and_an_earlier_file_survives(tokenizer, tmp_path):
    model = adapted(tiny("llama"))
    path = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="f16")
    before = (tmp_path / "gguf" / "model.F16.gguf").read_bytes()
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="f16")
    assert open(path, "rb").read() == before


def test_a_failed_write_leaves_the_earlier_file_and_no_debris(tokenizer, tmp_path, monkeypatch):
    model = adapted(tiny("llama"))
    folder = tmp_path / "gguf"
    model.save_pretrained_gguf(folder, tokenizer, quantization_method="q8_0")
    before = (folder / "model.Q8_0.gguf").read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gguf_export, "_encode", disk_full)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained_gguf(folder, tokenizer, quantization_method="q8_0")
    assert [p.name for p in folder.iterdir()] == ["model.Q8_0.gguf"]
    assert (folder / "model.Q8_0.gguf").read_bytes() == before


def test_a_foreign_file_of_the_same_name_needs_overwrite(tokenizer, tmp_path):
    model = adapted(tiny("llama"))
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "model.F16.gguf").write_text("my notes")
    with pytest.raises(FileExistsError, match="not a GGUF file; pass overwrite=True"):
        model.save_pretrained_gguf(folder, tokenizer, quantization_method="f16")
    assert (folder / "model.F16.gguf").read_text() == "my notes"
    model.save_pretrained_gguf(folder, tokenizer, quantization_method="f16", overwrite=True)
    assert (folder / "model.F16.gguf").read_bytes()[:4] == b"GGUF"
