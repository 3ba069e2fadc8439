"""slimrl's chunked KTO loss against unpatched TRL: same loss, same gradient on every trainable parameter, same metrics.

Each case builds TRL's trainer and slimrl's on identical weights, feeds both TRL's first collated micro-batch (mixed
labels, sequences of 7 to 37 tokens) and compares one compute_loss + backward, for num_chunks 1, 2 and 8 (8 = one
sequence per chunk).
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from tests.tolerances import assert_close
from tests.trainers.kto_harness import build_trainer, first_batch, kto_dataset, loss_grads_metrics
from tests.trainers.step_compare import assert_same_step
from tests.trainers.trainer_cache import TrainerCache

# (case id, config, reference kind, accumulation steps); reference kinds are described in kto_harness.build_trainer
CASES = [
    ("kto", dict(loss_type="kto"), "adapter", 1),
    ("apo_zero_unpaired", dict(loss_type="apo_zero_unpaired"), "adapter", 1),
    ("kto_weights", dict(loss_type="kto", desirable_weight=1.6, undesirable_weight=0.7), "adapter", 1),
    ("apo_weights_disabled_adapter", dict(loss_type="apo_zero_unpaired", desirable_weight=0.5, undesirable_weight=1.4),
     "disabled", 1),  # fmt: skip
    ("kto_precomputed_reference", dict(loss_type="kto", precompute_ref_log_probs=True), "disabled", 1),
    ("apo_precomputed_reference", dict(loss_type="apo_zero_unpaired", precompute_ref_log_probs=True), "disabled", 1),
    ("kto_reference_model", dict(loss_type="kto", undesirable_weight=1.3), "model", 1),
    ("kto_accumulation", dict(loss_type="kto", gradient_accumulation_steps=2), "adapter", 2),
]

_trainers: dict[str, tuple] = TrainerCache()
_expected: dict[tuple[str, bool], tuple] = {}


def trainers(case_id: str, config: dict, reference: str):
    """TRL's and slimrl's trainers for a case, built once; slimrl's num_chunks is set per test."""
    if case_id not in _trainers:
        _trainers[case_id] = tuple(build_trainer(kind, reference=reference, **config) for kind in ("trl", "slimrl"))
    return _trainers[case_id]


def expected_step(case_id: str, trainer, batch, accumulation: int = 1, train: bool = True):
    """TRL's step for a case, computed once (it does not depend on slimrl's num_chunks)."""
    key = (case_id, train)
    if key not in _expected:
        _expected[key] = loss_grads_metrics(trainer, batch, accumulation, train)
    return _expected[key]


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("case_id,config,reference,accumulation", CASES, ids=[c[0] for c in CASES])
def test_chunked_loss_matches_trl(case_id, config, reference, accumulation, num_chunks):
    trl_trainer, ours = trainers(case_id, config, reference)
    batch = first_batch(trl_trainer)
    ours.args.num_chunks = num_chunks
    expected = expected_step(case_id, trl_trainer, batch, accumulation)
    assert_same_step(expected, loss_grads_metrics(ours, batch, accumulation), f"{case_id}, num_chunks={num_chunks}")


def test_cases_exercise_the_kl_reference_point_and_both_labels():
    """The KTO case's KL point is positive (not clamped to 0) and its batch mixes labels, so the parity above covers
    the KL term and both branches of the loss."""
    trl_trainer, _ = trainers(*CASES[0][:3])
    batch = first_batch(trl_trainer)
    _, _, metrics = expected_step("kto", trl_trainer, batch)
    assert metrics["kl"] > 0.1
    assert 0 < int(batch["label"].sum()) < batch["label"].numel()
    lengths = batch["attention_mask"].sum(1)
    assert lengths.min() < lengths.max() // 2, "sequences of different lengths, so chunks drop right padding"


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_eval_loss_and_metrics_match_trl(num_chunks):
    """In eval (no grad, no accumulation) the chunked loss and TRL's eval metrics agree."""
    trl_trainer, ours = trainers(*CASES[0][:3])
    batch = first_batch(trl_trainer)
    ours.args.num_chunks = num_chunks
    expected = expected_step("kto", trl_trainer, batch, train=False)
    assert_same_step(expected, loss_grads_metrics(ours, batch, train=False), f"eval, {num_chunks}", train=False)


def test_batch_of_desirable_examples_only_logs_what_trl_logs():
    """Without undesirable rows TRL logs no rejected metrics and no margin; chunking logs the same names."""
    dataset = kto_dataset(labels=[True])
    trl_trainer = build_trainer("trl", dataset=dataset)
    ours = build_trainer("slimrl", dataset=dataset, num_chunks=3)
    batch = first_batch(trl_trainer)
    expected = loss_grads_metrics(trl_trainer, batch)
    assert "rewards/rejected" not in expected[2] and "rewards/margins" not in expected[2]
    assert_same_step(expected, loss_grads_metrics(ours, batch), "desirable only")


def test_precompute_pass_in_chunks_matches_trl():
    """The reference precompute pass scores a batch in chunks: the same log-probs, completion and KL, per row."""
    trl_trainer, ours = trainers(*CASES[4][:3])
    batch = first_batch(trl_trainer)
    ours.args.num_chunks = 3
    expected = trl_trainer.compute_ref_log_probs(trl_trainer.model, batch)
    actual = ours.compute_ref_log_probs(ours.model, batch)
    assert_close(actual[0], expected[0], name="reference completion log-probs")
    assert_close(actual[1], expected[1], name="reference KL log-probs")


def test_return_outputs_falls_back_to_trl(caplog):
    """return_outputs=True (compute_metrics in evaluation) needs the whole batch's outputs: TRL's path, logged."""
    trl_trainer, ours = trainers(*CASES[0][:3])
    batch = first_batch(trl_trainer)
    ours.args.num_chunks = 4
    results = []
    for trainer in (trl_trainer, ours):
        trainer.model.eval()
        trainer._metrics["eval"].clear()
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
            loss, outputs = trainer.compute_loss(trainer.model, dict(batch), return_outputs=True)
        results.append((loss, outputs.logits, {k: v[-1] for k, v in trainer._metrics["eval"].items()}))
    assert "because return_outputs=True asks for the model outputs" in caplog.text
    (loss_e, logits_e, metrics_e), (loss_a, logits_a, metrics_a) = results
    assert_close(loss_a, loss_e, name="loss")
    assert_close(logits_a, logits_e, name="logits")
    assert metrics_a == pytest.approx(metrics_e, rel=1e-6)


def tiny_moe(seed: int):
    config = MixtralConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           pad_token_id=0, eos_token_id=3, bos_token_id=None, output_router_logits=True)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MixtralForCausalLM(config)


def test_moe_load_balancing_loss_falls_back_to_trl(caplog):
    """The router's auxiliary loss couples all tokens of the micro-batch: TRL's one-piece loss runs, with a warning,
    and gives TRL's loss, gradients and metrics (aux_loss included)."""
    reference_models = (tiny_moe(2), tiny_moe(2))
    trl_trainer = build_trainer("trl", model=tiny_moe(1), reference="model",
                                trainer_kwargs={"ref_model": reference_models[0]})  # fmt: skip
    ours = build_trainer("slimrl", model=tiny_moe(1), reference="model", num_chunks=4,
                         trainer_kwargs={"ref_model": reference_models[1]})  # fmt: skip
    batch = first_batch(trl_trainer)
    expected = loss_grads_metrics(trl_trainer, batch)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = loss_grads_metrics(ours, batch)
    assert "because the MoE load-balancing loss depends on all tokens" in caplog.text
    assert "aux_loss" in expected[2]
    assert_same_step(expected, actual, "MoE")


# Logged values that measure time, not training results.
NOT_COMPARED = {"train_runtime", "train_samples_per_second", "train_steps_per_second"}


def train_log(kind: str, **config) -> list[dict]:
    trainer = build_trainer(kind, max_steps=3, learning_rate=5e-3, seed=7, per_device_train_batch_size=4,
                            gradient_accumulation_steps=2, gradient_checkpointing=True, **config)  # fmt: skip
    trainer.train()
    return trainer.state.log_history


def test_train_curve_matches_trl():
    """Three optimizer steps of 2 accumulated micro-batches, with gradient checkpointing (TRL's default) and
    non-default weights: slimrl in 3 chunks logs TRL's curve."""
    config = dict(loss_type="kto", desirable_weight=1.2, undesirable_weight=0.8)
    reference = train_log("trl", **config)
    ours = train_log("slimrl", num_chunks=3, **config)
    assert len(ours) == len(reference)
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        assert set(expected) - NOT_COMPARED == set(actual) - NOT_COMPARED, f"step {step}: different names logged"
        for name, value in expected.items():
            if name not in NOT_COMPARED and isinstance(value, (int, float)):
                # the first step's fp32 summation-order difference (1e-6) carried through Adam: 1e-4 relative
                assert actual[name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {step}: {name}"
    losses = [entry["loss"] for entry in reference if "loss" in entry]
    assert len(losses) == 3 and len(set(losses)) == 3, f"the curve is trivial: losses {losses}"
    assert all(entry["kl"] > 0 for entry in reference if "kl" in entry)
