"""bench/unsloth_side.py's `save_model`: what it writes loads in transformers as the same base model (the LoRA left
out), with a tokenizer over the whole vocabulary; Unsloth itself runs only on the GPU machine."""

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_saved_model_is_the_base_without_its_lora(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = load("common")
    model = common.w1_model(tiny=True, device="cpu", dtype=torch.float32, lora_b_std=0.5)  # LoRA changes outputs
    load("unsloth_side").save_model(model, tmp_path / "m")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    ids = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad(), model.disable_adapter():
        expected = model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(saved(input_ids=ids).logits, expected)
        assert not torch.allclose(model(input_ids=ids).logits, expected)  # the adapter was live, and left out
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.pad_token_id == 1 and tokenizer.eos_token_id == 2
