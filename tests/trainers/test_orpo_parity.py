"""slimrl's chunked ORPO step against unpatched TRL: same loss, same gradient on every LoRA parameter, same metrics;
the cases that run TRL's one-piece loss instead, and what `drop_chunk_padding` changes.

TRL's trainer and slimrl's are built on identical tiny LoRA models and fed the same collated batch of six pairs of
different lengths (the chosen answer sometimes the longer one, sometimes the shorter).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on import otherwise

import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model

from slimrl.testing import tiny_model
from tests.tolerances import assert_close
from tests.trainers.paired_harness import (
    PAIRS,
    assert_same_curves,
    assert_same_step,
    build_trainer,
    collated_batch,
    loss_grads_metrics,
    train_log,
)
from tests.trainers.trainer_cache import TrainerCache

_trainers: dict[tuple, object] = TrainerCache()


def trainers(arch: str = "llama", **config):
    """(TRL's, slimrl's) ORPO trainers for these settings, built once per module."""
    key = (arch, tuple(sorted(config.items())))
    if key not in _trainers:
        _trainers[key] = (build_trainer("orpo", "trl", arch=arch, **config),
                          build_trainer("orpo", "slimrl", arch=arch, **config))  # fmt: skip
    return _trainers[key]


@pytest.mark.parametrize("num_chunks,accumulation", [(1, 1), (2, 1), (8, 1), (3, 2)])
def test_chunked_orpo_matches_trl(num_chunks, accumulation):
    """Odds-ratio loss plus the NLL over every chosen token of the micro-batch; 8 chunks = one pair per chunk (capped
    at the six pairs); with 2 accumulation steps the inner chunks are scaled as HF Trainer scales the returned loss."""
    reference, ours = trainers()
    ours.args.num_chunks = num_chunks
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch, accumulation)
    actual = loss_grads_metrics(ours, batch, accumulation)
    assert_same_step(expected, actual, f"orpo, num_chunks={num_chunks}, accumulation={accumulation}")


def test_qwen2_matches_trl():
    """An architecture with biased attention projections."""
    reference, ours = trainers("qwen2")
    ours.args.num_chunks = 2
    batch = collated_batch(reference)
    assert_same_step(loss_grads_metrics(reference, batch), loss_grads_metrics(ours, batch), "qwen2, num_chunks=2")


def test_eval_matches_trl():
    """prediction_step (no grad): the same eval loss and eval_* metrics."""
    reference, ours = trainers()
    ours.args.num_chunks = 4
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch, train=False)
    actual = loss_grads_metrics(ours, batch, train=False)
    assert all(name.startswith("eval_") for name in actual[2])
    assert_same_step(expected, actual, "orpo eval, num_chunks=4", train=False)


def test_lm_head_module_never_runs_in_the_chunked_step():
    """The fused head reads the LM head's weight tile by tile: the head module itself, which would return the
    [tokens, vocab] logits, is never called (TRL's step calls it)."""
    reference, ours = trainers()
    ours.args.num_chunks = 2
    batch = collated_batch(reference)
    calls = {"trl": 0, "slimrl": 0}
    for kind, trainer in (("trl", reference), ("slimrl", ours)):
        head = trainer.model.get_base_model().get_output_embeddings()
        hook = head.register_forward_hook(lambda *args, kind=kind: calls.__setitem__(kind, calls[kind] + 1))
        try:
            loss_grads_metrics(trainer, batch)
        finally:
            hook.remove()
    assert calls == {"trl": 1, "slimrl": 0}


def _chunk_widths(trainer, batch) -> list[int]:
    widths = []
    embed = trainer.model.get_base_model().get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, output: widths.append(args[0].size(1)))
    try:
        loss_grads_metrics(trainer, batch)
    finally:
        hook.remove()
    return widths


def test_drop_chunk_padding_keeps_loss_and_gradient_and_averages_logits_over_attended_tokens():
    """With drop_chunk_padding each chunk stops at its longest pair: loss, gradient and every metric but logits/* are
    TRL's; logits/* average each attended position's mean logit (worked out here from the full logits)."""
    reference, ours = trainers(drop_chunk_padding=True)
    ours.args.num_chunks = 3
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch)
    actual = loss_grads_metrics(ours, batch)
    assert_same_step(expected, actual, "drop_chunk_padding", skip_metrics=("logits/chosen", "logits/rejected"))
    joined = reference.concatenated_inputs(batch, padding_value=reference.padding_value)
    ids, mask = joined["concatenated_input_ids"], joined["concatenated_attention_mask"]
    with torch.no_grad():
        mean_logits = reference.model(input_ids=ids, attention_mask=mask).logits.mean(-1)[:, :-1]  # [2B, T-1]
    attended = mask[:, :-1].bool()
    for side, rows in (("chosen", slice(0, PAIRS)), ("rejected", slice(PAIRS, None))):
        by_hand = mean_logits[rows][attended[rows]].mean()
        assert_close(torch.tensor(actual[2][f"logits/{side}"]), by_hand, name=f"logits/{side}")
    widths = _chunk_widths(ours, batch)
    assert len(widths) == 3 and max(widths) == ids.size(1) and min(widths) < ids.size(1), widths


def test_chunks_run_at_the_padded_width_by_default():
    """TRL's logits/* average over the padding columns too, so by default no chunk drops them."""
    reference, ours = trainers()
    ours.args.num_chunks = 3
    batch = collated_batch(reference)
    width = max(batch["chosen_input_ids"].size(1), batch["rejected_input_ids"].size(1))
    assert _chunk_widths(ours, batch) == [width] * 3


def test_return_outputs_runs_trls_one_piece_loss(caplog):
    """A caller asking compute_loss for its outputs may not backpropagate the loss, so no chunk is backpropagated
    inside: TRL's own step runs, with the same (loss, metrics)."""
    reference, ours = trainers()
    ours.args.num_chunks = 3
    batch = collated_batch(reference)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        loss, metrics = ours.compute_loss(ours.model, dict(batch), return_outputs=True)
    assert any("return outputs" in r.getMessage() and "in one piece" in r.getMessage() for r in caplog.records)
    expected_loss, expected_metrics = reference.compute_loss(reference.model, dict(batch), return_outputs=True)
    assert_close(loss.detach(), expected_loss.detach(), name="loss")
    assert metrics == pytest.approx(expected_metrics, rel=1e-5, abs=1e-6)


def test_labels_that_differ_from_the_input_ids_fall_back_to_trl(caplog):
    """ORPO's NLL reads the input ids and its sequence scores the labels; one chunked forward scores one target per
    position, so a batch whose labels disagree with its input ids runs TRL's one-piece loss."""
    reference, ours = trainers()
    ours.args.num_chunks = 2
    batch = collated_batch(reference)
    labels = batch["chosen_labels"].clone()
    row, column = 1, int((labels[1] != -100).nonzero()[0])
    labels[row, column] = (labels[row, column] + 1) % 256 + 4
    batch["chosen_labels"] = labels
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = loss_grads_metrics(ours, batch)
    assert any("labels differ from its input ids" in r.getMessage() for r in caplog.records)
    assert_same_step(loss_grads_metrics(reference, batch), actual, "labels differ from input ids")


def _lora_on_lm_head():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(tiny_model(), config)


def test_adapter_on_the_lm_head_falls_back_to_trl(caplog):
    """The fused head reads the head's base weight and would miss a LoRA on lm_head: TRL's one-piece loss runs, and
    the lm_head adapter gets TRL's gradient."""
    reference = build_trainer("orpo", "trl", model=_lora_on_lm_head())
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        ours = build_trainer("orpo", "slimrl", model=_lora_on_lm_head(), num_chunks=2)
        batch = collated_batch(reference)
        actual = loss_grads_metrics(ours, batch)
    assert any("LM head is a peft" in r.getMessage() and "in one piece" in r.getMessage() for r in caplog.records)
    expected = loss_grads_metrics(reference, batch)
    assert any("lm_head" in name for name in expected[1])
    assert_same_step(expected, actual, "LoRA on lm_head")


def test_train_curve_matches_trl_after_patching():
    """trainer.train() through `trl.experimental.orpo` names: PatchFastRL("orpo") gives slimrl's trainer, whose logged
    curve (loss, grad norm, every metric) over two optimizer steps of 2 accumulated micro-batches is TRL's; with
    gradient checkpointing, ORPO's default."""
    config = dict(gradient_checkpointing=True, output_dir="/tmp/slimrl-test-orpo-train")
    reference = train_log("orpo", patched=False, **config)
    ours = train_log("orpo", patched=True, num_chunks=2, **config)
    assert_same_curves(reference, ours)
