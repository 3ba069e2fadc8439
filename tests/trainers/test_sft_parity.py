"""slimrl's chunked SFT step against unpatched TRL: same loss, same gradient on every LoRA parameter, same metrics.

Each case builds TRL's trainer and slimrl's on identical weights and datasets, collates one batch from the prepared
data and compares one training_step (compute_loss, HF Trainer's accumulation scaling, backward) at num_chunks 1, 2 and
8 (8 = one sequence per chunk); TRL's result is computed once per case.
"""

from __future__ import annotations

import logging

import pytest
import torch

import slimrl
from slimrl.testing import tiny_tokenizer
from slimrl.trainers.sft.chunks import packed_chunk_inputs, packed_lengths, plan_packed
from tests.trainers.sft_harness import (
    GENERATION_CHATML,
    assert_same_curves,
    assert_same_step,
    build_sft,
    collated_batch,
    one_step,
    sft_dataset,
)
from tests.trainers.trainer_cache import TrainerCache


def chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = GENERATION_CHATML
    return tokenizer


# case id -> (dataset kind, config, accumulation steps, num_items_in_batch: None, or "twice" the batch's label count)
CASES = {
    "nll": ("text", dict(loss_type="nll"), 1, None),
    "dft": ("text", dict(loss_type="dft"), 1, None),
    # prompt-completion data: completion_only_loss defaults to True there
    "completion_only": ("prompt_completion", dict(), 1, None),
    "prompt_completion_full_loss": ("prompt_completion", dict(completion_only_loss=False, loss_type="dft"), 1, None),
    "assistant_only": ("messages", dict(assistant_only_loss=True), 1, None),
    # bfd packing is padding-free: the batch is one row of whole sequences whose position ids restart at 0
    "packing_padding_free": ("short_text", dict(packing=True, max_length=32, per_device_train_batch_size=3), 1, None),
    # padding-free without packing: the batch's examples, each whole, flattened into one row
    "padding_free": ("text", dict(padding_free=True, max_length=None, loss_type="dft"), 1, None),
    # as in trainer.train(): num_items_in_batch counts the label tokens of both micro-batches, the loss is divided by
    # it, and HF Trainer does not divide by the accumulation steps
    "accumulation_num_items": ("prompt_completion", dict(gradient_accumulation_steps=2), 2, "twice"),
    # without num_items_in_batch HF Trainer divides the loss by the accumulation steps: inner chunks must be too
    "accumulation_no_num_items": ("text", dict(gradient_accumulation_steps=2, loss_type="dft"), 2, None),
}

_cache: dict[str, tuple] = TrainerCache()


def case(case_id: str):
    """(slimrl's trainer, the batch, accumulation, num_items_in_batch, TRL's step result), built once per case."""
    if case_id not in _cache:
        kind, config, accumulation, num_items = CASES[case_id]
        dataset = sft_dataset(kind)
        tokenizer = chat_tokenizer if kind == "messages" else tiny_tokenizer
        reference = build_sft("trl", dataset=dataset, tokenizer=tokenizer(), **config)
        ours = build_sft("slimrl", dataset=dataset, tokenizer=tokenizer(), **config)
        batch = collated_batch(reference, config.get("per_device_train_batch_size", 8))
        if num_items == "twice":
            num_items = (batch["labels"][:, 1:] != -100).sum() * 2
        expected = one_step(reference, batch, accumulation, num_items)
        _cache[case_id] = (ours, batch, accumulation, num_items, expected)
    return _cache[case_id]


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("case_id", list(CASES))
def test_chunked_step_matches_trl(case_id, num_chunks, caplog):
    ours, batch, accumulation, num_items, expected = case(case_id)
    ours.args.num_chunks = num_chunks
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = one_step(ours, batch, accumulation, num_items)
    assert "one piece" not in caplog.text, f"{case_id} fell back to TRL's path: {caplog.text}"
    assert_same_step(expected, actual, f"{case_id}, num_chunks={num_chunks}")


def test_cases_exercise_what_they_name():
    """The masks and the packed layout really are in the batches the parity cases feed."""
    _, batch, *_ = case("completion_only")
    assert ((batch["labels"] == -100) & (batch["attention_mask"] == 1)).any(), "no prompt token is masked"
    _, batch, *_ = case("assistant_only")
    labelled = (batch["labels"] != -100).sum(1)
    assert (labelled > 0).all() and (labelled < batch["attention_mask"].sum(1)).all(), "user turns are not masked"
    for case_id in ("packing_padding_free", "padding_free"):
        _, batch, *_ = case(case_id)
        assert "attention_mask" not in batch and batch["input_ids"].size(0) == 1
        starts = int((batch["position_ids"][0] == 0).sum())
        assert starts >= 8, f"{case_id}: {starts} packed sequences, so 8 chunks are untested"


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_evaluation_matches_trl(num_chunks):
    """prediction_step (no gradient, eval metrics) through the chunks."""
    ours, batch, *_ = case("completion_only")
    reference = build_sft("trl", dataset=sft_dataset("prompt_completion"))
    ours.args.num_chunks = num_chunks
    assert_same_step(one_step(reference, batch, train=False), one_step(ours, batch, train=False), "eval")


def test_label_smoothing_falls_back_to_trl_and_says_why(caplog):
    """Label smoothing needs the full logits: the batch runs through TRL's one-piece loss, with a warning."""
    dataset = sft_dataset("text")
    reference = build_sft("trl", dataset=dataset, label_smoothing_factor=0.1)
    ours = build_sft("slimrl", dataset=dataset, label_smoothing_factor=0.1, num_chunks=4)
    batch = collated_batch(reference)
    expected = one_step(reference, batch)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = one_step(ours, batch)
    assert "one piece (TRL's path) because label smoothing needs the model's full logits" in caplog.text
    assert_same_step(expected, actual, "label smoothing fallback")


def test_return_outputs_falls_back_to_trl(caplog):
    ours, batch, *_ = case("nll")
    ours.args.num_chunks = 2
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"), torch.no_grad():
        loss, outputs = ours.compute_loss(ours.model, dict(batch), return_outputs=True)
    assert "return_outputs=True" in caplog.text
    assert outputs.logits.shape[:2] == batch["input_ids"].shape


# -- a few optimizer steps ---------------------------------------------------------------------------------------------


def train_log(patched: bool) -> list[dict]:
    """Three optimizer steps of 2 micro-batches each on prompt-completion data, through trl.SFTTrainer: slimrl's
    when patched."""
    import trl

    if patched:
        slimrl.PatchFastRL("sft")
    try:
        assert (trl.SFTTrainer is slimrl.SFTTrainer) == patched
        config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                      learning_rate=5e-3, seed=3)  # fmt: skip
        if patched:
            config["num_chunks"] = 3
        trainer = build_sft("patched", dataset=sft_dataset("prompt_completion", n=24), **config)
        trainer.train()
        return trainer.state.log_history
    finally:
        slimrl.unpatch("sft")


def test_train_curve_matches_trl(caplog):
    reference = train_log(patched=False)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        ours = train_log(patched=True)
    assert "one piece" not in caplog.text, caplog.text
    assert_same_curves(reference, ours)


# -- the chunk plan --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id,num_chunks,expected", [("nll", 3, 3), ("nll", 8, 8), ("packing_padding_free", 4, 4),
                                                         ("padding_free", 20, 8)])  # fmt: skip
def test_each_chunk_is_one_forward(case_id, num_chunks, expected):
    """num_chunks forwards per micro-batch (at most one per row, or per packed sequence)."""
    ours, batch, accumulation, num_items, _ = case(case_id)
    ours.args.num_chunks = num_chunks
    calls = []
    hook = ours.model.get_base_model().model.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        one_step(ours, batch, accumulation, num_items)
    finally:
        hook.remove()
    assert len(calls) == expected


def test_packed_chunks_are_whole_consecutive_sequences_of_near_equal_size():
    lengths = [13, 12, 7, 11, 11, 9, 9, 9, 9]
    for count in range(1, 12):
        chunks = plan_packed(lengths, count)
        assert len(chunks) == min(count, len(lengths))
        assert [n for chunk in chunks for n in chunk.lengths] == lengths  # every sequence once, in order
        assert chunks[0].start == 0 and chunks[-1].end == sum(lengths)
        for before, after in zip(chunks, chunks[1:], strict=False):
            assert before.end == after.start
        for chunk in chunks:
            assert chunk.end - chunk.start == sum(chunk.lengths)
    sizes = [sum(chunk.lengths) for chunk in plan_packed(lengths, 3)]
    assert sizes == [32, 31, 27], sizes  # cut at the sequence ends nearest 90/3 and 2 * 90/3


def test_packed_chunk_inputs_restart_their_boundaries():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    inputs = {"input_ids": torch.arange(9)[None], "labels": torch.arange(9)[None], "position_ids": position_ids,
              "cu_seq_lens_q": torch.tensor([0, 3, 5, 9], dtype=torch.int32), "max_length_q": 4,
              "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]], dtype=torch.int32)}  # fmt: skip
    lengths, reason = packed_lengths(inputs)
    assert lengths == [3, 2, 4] and reason is None
    first, second = (packed_chunk_inputs(inputs, chunk) for chunk in plan_packed(lengths, 2))
    assert first["input_ids"].tolist() == [[0, 1, 2, 3, 4]] and second["input_ids"].tolist() == [[5, 6, 7, 8]]
    assert first["cu_seq_lens_q"].tolist() == [0, 3, 5] and first["max_length_q"] == 3
    assert first["seq_idx"].tolist() == [[0, 0, 0, 1, 1]] and "cu_seq_lens_k" not in first
    assert second["cu_seq_lens_q"].tolist() == [0, 4] and second["position_ids"].tolist() == [[0, 1, 2, 3]]
    inputs["cu_seq_lens_q"] = torch.tensor([0, 4, 9], dtype=torch.int32)
    assert packed_lengths(inputs) == (None, "cu_seq_lens_q does not match the sequence starts given by position_ids")
