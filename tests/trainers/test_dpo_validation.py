"""Inputs and settings TRL's DPOTrainer lets through to a later crash: each is an error (or a warning) naming the fix.
Also the constructor's contract: TRL's signature, TRL's own errors unchanged, a plain trl.DPOConfig accepted."""

from __future__ import annotations

import inspect
import logging

import pytest
import trl
from datasets import Dataset
from peft import LoraConfig

import slimrl
from slimrl.testing import tiny_model, tiny_tokenizer
from tests.trainers.dpo_harness import LORA, dpo_config, loss_grads_metrics, preference_batch, preference_dataset


def build(dataset=None, config=None, model=None, **trainer_kwargs):
    return slimrl.DPOTrainer(model=tiny_model() if model is None else model, args=config or dpo_config(),
                             train_dataset=preference_dataset() if dataset is None else dataset,
                             processing_class=tiny_tokenizer(), peft_config=LoraConfig(**LORA),
                             **trainer_kwargs)  # fmt: skip


def test_constructor_has_trls_signature():
    ours = inspect.signature(slimrl.DPOTrainer.__init__).parameters
    theirs = inspect.signature(trl.DPOTrainer.__init__).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


def test_trls_own_errors_keep_their_text():
    with pytest.raises(ValueError, match=r"`train_dataset` is required"):
        slimrl.DPOTrainer(model=tiny_model(), args=dpo_config(), processing_class=tiny_tokenizer())


def test_dataset_without_chosen_and_rejected_columns():
    dataset = preference_dataset().rename_columns({"chosen": "good", "rejected": "bad"})
    with pytest.raises(ValueError, match=r"train_dataset has columns \['prompt', 'good', 'bad'\] but DPO needs "
                                         r"'chosen', 'rejected' columns.*'chosen', 'rejected' are missing.*"
                                         r"rename_columns"):  # fmt: skip
        build(dataset)


def test_eval_split_without_rejected_column_is_named():
    evals = {"held_out": preference_dataset().remove_columns("rejected")}
    with pytest.raises(ValueError, match=r"eval_dataset\['held_out'\] has columns .*'rejected' is missing"):
        build(eval_dataset=evals)


def test_mixed_conversational_and_plain_columns():
    chat = preference_dataset(conversational=True)
    dataset = Dataset.from_dict({"prompt": chat["prompt"], "chosen": preference_dataset()["chosen"],
                                 "rejected": chat["rejected"]})  # fmt: skip
    with pytest.raises(ValueError, match=r"mixes formats in its first row: 'prompt' is conversational, 'chosen' is "
                                         r"standard, 'rejected' is conversational\. Use one format"):  # fmt: skip
        build(dataset)


def test_column_that_is_neither_text_nor_messages():
    dataset = Dataset.from_dict({"prompt": ["Hi"], "chosen": [["Hello", "there"]], "rejected": ["Bye"]})
    with pytest.raises(ValueError, match=r"'chosen' holds a list of str; each of .* must be a string"):
        build(dataset)


def test_conversational_dataset_trains_through_the_chunked_path():
    """The format check accepts a well-formed chat dataset (TRL applies the chat template)."""
    trainer = build(preference_dataset(conversational=True), dpo_config(num_chunks=2))
    loss, grads, metrics = loss_grads_metrics(trainer, preference_batch(trainer))
    assert loss.isfinite() and grads and metrics["num_tokens"] > 0
    assert not trainer.__dict__.get("_fallback_reasons_logged")


def long_dataset(length: int) -> Dataset:
    return Dataset.from_dict({"prompt": ["Q"], "chosen": ["x" * length], "rejected": ["y"]})


def test_untruncated_sequences_beyond_max_seq_length_are_an_error():
    model = tiny_model()
    model.slimrl_options = type("Options", (), {"max_seq_length": 64})()  # as FastLanguageModel records it
    with pytest.raises(ValueError, match=r"prompt\+completion of 102 tokens with max_length=None \(no truncation\), "
                                         r"beyond the model's context of 64 tokens \(max_seq_length given to "
                                         r"FastLanguageModel.*Set max_length=64"):  # fmt: skip
        build(long_dataset(100), dpo_config(max_length=None), model=model)


def test_truncation_to_the_context_passes():
    model = tiny_model()
    model.slimrl_options = type("Options", (), {"max_seq_length": 64})()
    trainer = build(long_dataset(100), dpo_config(max_length=64), model=model)
    assert len(trainer.data_collator([trainer.train_dataset[0]])["input_ids"][0]) == 64


def test_untruncated_sequences_beyond_the_position_embeddings_warn():
    """transformers' RoPE runs past max_position_embeddings and TRL trains there, so it is a warning (as in GRPO)."""
    with pytest.warns(UserWarning, match=r"prompt\+completion of 602 tokens .* context of 512 tokens \(the model's "
                                         r"max_position_embeddings\)"):  # fmt: skip
        build(long_dataset(600), dpo_config(max_length=None))


def test_wpo_weights_with_sft_loss_are_refused_at_construction():
    """TRL 1.16 accepts this pair of options and then fails inside its first loss computation."""
    with pytest.raises(ValueError, match=r"use_weighting=True cannot be combined with loss_type 'sft'.*Drop 'sft'"):
        build(config=dpo_config(loss_type=["sigmoid", "sft"], use_weighting=True))


def test_unknown_loss_type_falls_back_to_trls_error(caplog):
    """A loss type slimrl does not know runs through TRL's loss, which computes it or raises its own error."""
    trainer = build(config=dpo_config(loss_type="not_a_loss", num_chunks=2))
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"), pytest.raises(ValueError, match="not_a_loss"):
        loss_grads_metrics(trainer, preference_batch(trainer))
    assert any("'not_a_loss' is not one slimrl knows how to chunk" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("bad", [0, -1, "many"])
def test_num_chunks_range(bad):
    with pytest.raises(ValueError, match=r"num_chunks must be a positive integer or 'auto'"):
        dpo_config(num_chunks=bad)


def test_plain_trl_config_gets_slimrl_fields():
    """A trl.DPOConfig keeps its values and gains slimrl's fields at their defaults."""
    trainer = build(config=dpo_config("trl", beta=0.3))
    assert trainer.args.num_chunks == "auto" and trainer.args.on_nonfinite == "raise" and trainer.args.beta == 0.3
    assert isinstance(slimrl.DPOConfig(output_dir="/tmp/x", use_cpu=True), trl.DPOConfig)
