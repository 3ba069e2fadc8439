"""slimrl's chunked reward-model step against unpatched TRL: same loss, same gradient on every LoRA parameter (and the
score head), same metrics, at num_chunks 1, 2 and 8 (8 = one pair per chunk); evaluation returns TRL's rewards."""

from __future__ import annotations

import logging

import pytest

import slimrl
from tests.tolerances import assert_close
from tests.trainers.sft_harness import (
    assert_same_curves,
    assert_same_step,
    build_reward,
    collated_batch,
    one_step,
    preference_dataset,
)
from tests.trainers.trainer_cache import TrainerCache

# case id -> (config, dataset options, accumulation steps)
CASES = {
    "plain": (dict(), dict(), 1),
    "margin": (dict(), dict(margin=True), 1),
    "margin_centered": (dict(center_rewards_coefficient=0.05), dict(margin=True), 1),
    # RewardTrainer's loss is a mean over pairs: HF Trainer divides it by the accumulation steps, inner chunks too
    "accumulation_centered": (dict(center_rewards_coefficient=0.1, gradient_accumulation_steps=2), dict(), 2),
}

_cache: dict[str, tuple] = TrainerCache()


def case(case_id: str):
    """(slimrl's trainer, the batch, accumulation, TRL's training step, TRL's evaluation step), built once."""
    if case_id not in _cache:
        config, data, accumulation = CASES[case_id]
        dataset = preference_dataset(**data)
        reference = build_reward("trl", dataset=dataset, **config)
        ours = build_reward("slimrl", dataset=dataset, **config)
        batch = collated_batch(reference)
        expected = one_step(reference, batch, accumulation)
        expected_eval = one_step(reference, batch, train=False)
        _cache[case_id] = (ours, batch, accumulation, expected, expected_eval)
    return _cache[case_id]


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("case_id", list(CASES))
def test_chunked_step_matches_trl(case_id, num_chunks, caplog):
    ours, batch, accumulation, expected, _ = case(case_id)
    ours.args.num_chunks = num_chunks
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = one_step(ours, batch, accumulation)
    assert "one piece" not in caplog.text, f"{case_id} fell back to TRL's path: {caplog.text}"
    assert_same_step(expected, actual, f"{case_id}, num_chunks={num_chunks}")


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_evaluation_returns_trls_rewards(num_chunks, caplog):
    """Evaluation asks compute_loss for the outputs: the chunks' rewards are assembled into TRL's logits [2P, 1]."""
    ours, batch, _, _, expected = case("margin_centered")
    ours.args.num_chunks = num_chunks
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = one_step(ours, batch, train=False)
    assert "one piece" not in caplog.text
    assert_same_step(expected, actual, f"eval, num_chunks={num_chunks}")


def test_outputs_with_gradients_fall_back_to_trl(caplog):
    """compute_loss(return_outputs=True) while training wants logits on the whole batch's graph: TRL's path."""
    ours, batch, *_ = case("margin")
    reference = build_reward("trl", dataset=preference_dataset(margin=True))
    ours.args.num_chunks = 4
    results = []
    for trainer in (reference, ours):
        trainer.model.train()
        with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
            loss, outputs = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
        assert outputs.logits.requires_grad
        results.append((loss.detach(), outputs.logits.detach()))
    assert "one piece (TRL's path) because return_outputs=True with gradients" in caplog.text
    assert_close(results[1][0], results[0][0], name="loss")
    assert_close(results[1][1], results[0][1], name="logits")


def test_batch_carries_what_the_cases_name():
    _, batch, *_ = case("margin")
    assert batch["margin"].abs().min() > 0 and batch["input_ids"].size(0) == 16
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 4, "the pairs are not ragged, so no chunk drops padding"


def train_log(patched: bool) -> list[dict]:
    """Three optimizer steps of 2 micro-batches each, with margins and centred rewards, through trl.RewardTrainer:
    slimrl's when patched."""
    import trl

    if patched:
        slimrl.PatchFastRL("reward")
    try:
        assert (trl.RewardTrainer is slimrl.RewardTrainer) == patched
        config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3, logging_steps=1,
                      learning_rate=5e-3, seed=3, center_rewards_coefficient=0.01)  # fmt: skip
        if patched:
            config["num_chunks"] = 3
        trainer = build_reward("patched", dataset=preference_dataset(n=24, margin=True), **config)
        trainer.train()
        return trainer.state.log_history
    finally:
        slimrl.unpatch("reward")


def test_train_curve_matches_trl(caplog):
    reference = train_log(patched=False)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        ours = train_log(patched=True)
    assert "one piece" not in caplog.text, caplog.text
    assert_same_curves(reference, ours)
