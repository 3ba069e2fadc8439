"""slimrl's chunked CPO step against unpatched TRL, for every loss_type: same loss, same gradient on every LoRA
parameter, same metrics; the chat-format path, eval, training through the patched names, and the fallback a subclass
that changes the loss gets.

TRL's trainer and slimrl's are built on identical tiny LoRA models and fed the same collated batch of six pairs of
different lengths. With beta=0.2 and summed log-probs the hinge margins land on both sides of the hinge.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on import otherwise

import logging

import pytest
import torch

from tests.trainers.paired_harness import (
    assert_same_curves,
    assert_same_step,
    build_trainer,
    build_with_classes,
    collated_batch,
    loss_grads_metrics,
    preference_dataset,
    train_log,
    trainer_classes,
)
from tests.trainers.trainer_cache import TrainerCache

TRLCPOTrainer, TRLCPOConfig = trainer_classes("cpo", "trl")
CPOTrainer, CPOConfig = trainer_classes("cpo", "slimrl")

# (case id, config)
CASES = [
    ("sigmoid_label_smoothing", dict(loss_type="sigmoid", label_smoothing=0.1)),
    ("hinge", dict(loss_type="hinge")),
    ("ipo", dict(loss_type="ipo")),
    ("simpo_gamma_label_smoothing", dict(loss_type="simpo", simpo_gamma=0.3, cpo_alpha=0.5, label_smoothing=0.1)),
    ("alphapo", dict(loss_type="alphapo", alpha=0.3)),
    ("sigmoid_without_nll", dict(loss_type="sigmoid", cpo_alpha=0.0)),
]

_trainers: dict[str, tuple] = TrainerCache()


def trainers(case_id: str, config: dict, dataset=None):
    """(TRL's, slimrl's) CPO trainers for a case, built once per module."""
    if case_id not in _trainers:
        _trainers[case_id] = (build_trainer("cpo", "trl", dataset=dataset, **config),
                              build_trainer("cpo", "slimrl", dataset=dataset, **config))  # fmt: skip
    return _trainers[case_id]


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("case_id,config", CASES, ids=[case[0] for case in CASES])
def test_chunked_cpo_matches_trl(case_id, config, num_chunks):
    reference, ours = trainers(case_id, config)
    ours.args.num_chunks = num_chunks
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch)
    actual = loss_grads_metrics(ours, batch)
    assert_same_step(expected, actual, f"{case_id}, num_chunks={num_chunks}")


def test_hinge_case_has_pairs_on_both_sides_of_the_hinge():
    """The hinge parity case is only a test of the kink if some pairs are past it (zero loss) and some are not."""
    reference, _ = trainers("hinge", dict(loss_type="hinge"))
    batch = collated_batch(reference)
    with torch.no_grad():
        chosen, rejected = reference.concatenated_forward(reference.model, batch)[:2]
        losses = reference.cpo_loss(chosen, rejected)[0]
    assert (losses == 0).any() and (losses > 0).any(), losses


def test_conversational_dataset_with_gradient_accumulation_matches_trl():
    """Chat-message prompts and answers (TRL applies the chat template) and 2 accumulation steps."""
    reference, ours = trainers("chat", dict(loss_type="simpo"), dataset=preference_dataset(conversational=True))
    ours.args.num_chunks = 3
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch, accumulation=2)
    actual = loss_grads_metrics(ours, batch, accumulation=2)
    assert_same_step(expected, actual, "conversational simpo, num_chunks=3, accumulation=2")


def test_eval_matches_trl():
    reference, ours = trainers("sigmoid_label_smoothing", dict(CASES[0][1]))
    ours.args.num_chunks = 2
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch, train=False)
    actual = loss_grads_metrics(ours, batch, train=False)
    assert_same_step(expected, actual, "cpo eval, num_chunks=2", train=False)


def _margin_loss(trainer, chosen_logps, rejected_logps):
    margin = chosen_logps - rejected_logps
    return torch.nn.functional.softplus(-trainer.beta * margin) * 2.0, trainer.beta * chosen_logps.detach(), \
        trainer.beta * rejected_logps.detach()  # fmt: skip


class TRLCustomLoss(TRLCPOTrainer):
    def cpo_loss(self, chosen_logps, rejected_logps):
        return _margin_loss(self, chosen_logps, rejected_logps)


class SlimCustomLoss(CPOTrainer):
    def cpo_loss(self, chosen_logps, rejected_logps):
        return _margin_loss(self, chosen_logps, rejected_logps)


def test_a_subclass_with_its_own_cpo_loss_runs_trls_path(caplog):
    """The chunked step does not call cpo_loss; a subclass that overrides it gets TRL's one-piece step, so its loss is
    the one trained (a silent switch back to the built-in loss would be a wrong gradient)."""
    reference = build_with_classes(TRLCustomLoss, TRLCPOConfig, "cpo")
    ours = build_with_classes(SlimCustomLoss, CPOConfig, "cpo", num_chunks=2)
    batch = collated_batch(reference)
    expected = loss_grads_metrics(reference, batch)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = loss_grads_metrics(ours, batch)
    assert any("overrides cpo_loss" in r.getMessage() and "in one piece" in r.getMessage() for r in caplog.records)
    assert_same_step(expected, actual, "custom cpo_loss")
    builtin = loss_grads_metrics(trainers(*CASES[0])[0], batch)
    assert abs(builtin[0].item() - actual[0].item()) > 1e-3, "the custom loss did not change the loss"


def test_train_curve_matches_trl_after_patching():
    """trainer.train() through `trl.experimental.cpo` names after PatchFastRL("cpo"): two optimizer steps of 2
    accumulated micro-batches give TRL's logged curve (SimPO with the NLL term, gradient checkpointing on)."""
    config = dict(loss_type="simpo", cpo_alpha=0.5, gradient_checkpointing=True,
                  output_dir="/tmp/slimrl-test-cpo-train")  # fmt: skip
    reference = train_log("cpo", patched=False, **config)
    ours = train_log("cpo", patched=True, num_chunks=2, **config)
    assert_same_curves(reference, ours)
