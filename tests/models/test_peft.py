"""get_peft_model (LoRA targets, frozen base, seeding, checkpointing modes) and for_inference / for_training."""

from __future__ import annotations

import sys

import pytest
import torch

from slimrl import FastLanguageModel
from slimrl.models import lora, modes
from slimrl.models.unwrap import hf_model
from slimrl.testing import tiny_model
from tests.models.helpers import CONTEXT, PROMPT, PROMPT_MASK, save_tiny


@pytest.fixture
def loaded(tmp_path, arch):
    return FastLanguageModel.from_pretrained(str(save_tiny(tmp_path / "tiny", arch)), max_seq_length=CONTEXT)


def checkpointing_on(model) -> bool:
    return modes.checkpointing_is_on(hf_model(model))


def embedding_hooks(model) -> int:
    return len(hf_model(model).get_input_embeddings()._forward_hooks)


# -- targets ---------------------------------------------------------------------------------------------------------


def test_lora_targets_are_the_seven_projections_found_by_name(arch):
    assert lora.find_lora_targets(tiny_model(arch)) == list(lora.LLAMA_PROJECTIONS)


def test_lora_targets_error_lists_the_linear_layers_that_exist():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match=r"No Llama-style projections.*named \['lm_head'\].*target_modules"):
        lora.find_lora_targets(model)


def test_a_model_with_some_projections_fused_gets_the_rest_and_a_warning(caplog):
    model = tiny_model("llama")
    for layer in model.model.layers:  # as Phi-3 does: one fused gate_up projection
        layer.mlp.gate_up_proj = layer.mlp.gate_proj
        del layer.mlp.gate_proj, layer.mlp.up_proj
    with caplog.at_level("WARNING", logger="slimrl.models.lora"):
        targets = lora.find_lora_targets(model)
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    assert "no ['gate_proj', 'up_proj']" in caplog.text and "gate_up_proj" in caplog.text


def test_get_peft_model_adapts_all_projections_and_freezes_the_base(loaded):
    model, _ = loaded
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == set(lora.LLAMA_PROJECTIONS)  # ...q_proj.lora_A.default.w
    assert model.training and not model.config.use_cache and checkpointing_on(model)


def test_explicit_targets_and_modules_to_save_are_passed_to_peft(loaded):
    model, _ = loaded
    model = FastLanguageModel.get_peft_model(
        model, r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]
    )
    adapted = {name.split(".")[-4] for name, p in model.named_parameters() if "lora_" in name}
    assert adapted == {"q_proj", "v_proj"}
    assert any("lm_head.modules_to_save" in name and p.requires_grad for name, p in model.named_parameters())


def test_random_state_seeds_the_lora_init(tmp_path):
    path = save_tiny(tmp_path / "tiny")
    weights = []
    for seed in (11, 11, 12):
        model, _ = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
        model = FastLanguageModel.get_peft_model(model, r=4, random_state=seed)
        weights.append(next(p for n, p in model.named_parameters() if "lora_A" in n).detach().clone())
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_global_rng_is_untouched_by_get_peft_model(tmp_path):
    model, _ = FastLanguageModel.from_pretrained(str(save_tiny(tmp_path / "tiny")), max_seq_length=CONTEXT)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    FastLanguageModel.get_peft_model(model, r=4, random_state=123)
    assert torch.equal(torch.rand(3), expected)


def test_second_adapter_is_refused(loaded):
    model = FastLanguageModel.get_peft_model(loaded[0], r=4)
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        FastLanguageModel.get_peft_model(model, r=4)


def test_rank_above_max_lora_rank_is_refused(tmp_path):
    path = save_tiny(tmp_path / "tiny")
    model, _ = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT, max_lora_rank=8)
    with pytest.raises(ValueError, match="r=16 exceeds max_lora_rank=8"):
        FastLanguageModel.get_peft_model(model, r=16)


def test_bad_gradient_checkpointing_choice_is_refused(loaded):
    with pytest.raises(ValueError, match="use_gradient_checkpointing must be True, False or 'offload'"):
        FastLanguageModel.get_peft_model(loaded[0], use_gradient_checkpointing="sometimes")


def test_a_model_not_loaded_by_slimrl_gets_options_too():
    model = FastLanguageModel.get_peft_model(tiny_model("qwen2"), r=4, use_gradient_checkpointing=False)
    assert model.slimrl_options.max_seq_length == 512 and model.slimrl_options.gradient_checkpointing is False


# -- gradient checkpointing ------------------------------------------------------------------------------------------


def lora_grads_of_one_step(model) -> dict:
    model.zero_grad(set_to_none=True)
    model(input_ids=PROMPT, attention_mask=PROMPT_MASK, labels=PROMPT).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", [True, "offload", "unsloth"])
def test_checkpointed_lora_gets_the_same_gradients_as_without(tmp_path, mode):
    """Checkpointing (plain or offloaded) with a frozen embedding still backpropagates into every LoRA weight."""
    path = save_tiny(tmp_path / "tiny")
    grads = []
    for checkpointing in (False, mode):
        model, _ = FastLanguageModel.from_pretrained(str(path), max_seq_length=CONTEXT)
        model = FastLanguageModel.get_peft_model(
            model, r=4, use_gradient_checkpointing=checkpointing, init_lora_weights=False
        )
        assert checkpointing_on(model) == bool(checkpointing)
        grads.append(lora_grads_of_one_step(model))
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7)


def test_offload_without_the_checkpointing_module_is_a_clear_error(loaded, monkeypatch):
    import slimrl.models

    monkeypatch.setitem(sys.modules, "slimrl.models.checkpointing", None)  # makes the import fail
    monkeypatch.delattr(slimrl.models, "checkpointing", raising=False)
    with pytest.raises(NotImplementedError, match="use_gradient_checkpointing=True"):
        FastLanguageModel.get_peft_model(loaded[0], r=4, use_gradient_checkpointing="offload")


# -- modes -----------------------------------------------------------------------------------------------------------


def test_mode_switching_flips_train_flag_cache_checkpointing_and_padding(loaded):
    model, tokenizer = loaded
    assert not model.training  # from_pretrained gives an eval-mode model
    model = FastLanguageModel.get_peft_model(model, r=4)
    assert all(m.training for m in model.modules())  # every layer, not only the fresh peft wrapper
    assert FastLanguageModel.for_inference(model) is model
    assert not any(m.training for m in model.modules())
    assert model.config.use_cache and not checkpointing_on(model) and tokenizer.padding_side == "left"
    assert FastLanguageModel.for_training(model) is model
    assert all(m.training for m in model.modules())
    assert not model.config.use_cache and checkpointing_on(model) and tokenizer.padding_side == "left"


@pytest.mark.parametrize("mode", [True, "offload"])
def test_decoder_layers_are_really_recomputed_after_get_peft_model(loaded, monkeypatch, mode):
    """The checkpoint function runs once per decoder layer in a training forward (it is skipped in eval mode)."""
    model = FastLanguageModel.get_peft_model(loaded[0], r=4, use_gradient_checkpointing=mode)
    calls = []
    for layer in hf_model(model).model.layers:
        original = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k)
    model(input_ids=PROMPT, attention_mask=PROMPT_MASK, labels=PROMPT).loss.backward()
    assert len(calls) == 2


def test_for_training_restores_offloaded_checkpointing(loaded):
    from slimrl.models.checkpointing import is_offloaded_checkpointing

    model = FastLanguageModel.get_peft_model(loaded[0], r=4, use_gradient_checkpointing="offload")
    FastLanguageModel.for_inference(model)
    assert not checkpointing_on(model)
    FastLanguageModel.for_training(model)
    assert checkpointing_on(model) and is_offloaded_checkpointing(model)


def test_for_training_keeps_checkpointing_off_when_it_was_not_asked(loaded):
    model = FastLanguageModel.get_peft_model(loaded[0], r=4, use_gradient_checkpointing=False)
    FastLanguageModel.for_inference(model)
    FastLanguageModel.for_training(model)
    assert model.training and not checkpointing_on(model) and not model.config.use_cache


def test_training_padding_side_chosen_by_the_user_comes_back_after_inference(loaded):
    model, tokenizer = loaded
    model = FastLanguageModel.get_peft_model(model, r=4)
    tokenizer.padding_side = "right"  # e.g. for a supervised phase
    FastLanguageModel.for_inference(model)
    assert tokenizer.padding_side == "left"
    FastLanguageModel.for_training(model)
    assert tokenizer.padding_side == "right"


def test_mode_switches_are_idempotent_and_do_not_pile_up_hooks(loaded):
    """Called every step: repeated switches keep one input-grad hook and follow the real state, even after the
    trainer flipped train/eval behind their back."""
    model = FastLanguageModel.get_peft_model(loaded[0], r=4)
    hooks = embedding_hooks(model)
    assert hooks == 1
    for _ in range(3):
        FastLanguageModel.for_inference(model)
        FastLanguageModel.for_inference(model)
        FastLanguageModel.for_training(model)
        FastLanguageModel.for_training(model)
    assert embedding_hooks(model) == hooks
    model.eval()  # someone else switched modes
    FastLanguageModel.for_training(model)
    assert model.training
