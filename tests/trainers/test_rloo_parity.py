"""slimrl's RLOO trainer against unpatched TRL: same loss, gradients and metrics for a fixed batch at every chunk
count, the same generated batch (rewards, KL penalty, leave-one-out advantages), the same training curve, and a
resumed run equal to an uninterrupted one."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
import trl

import slimrl
from slimrl.testing import tiny_prompt_dataset, tiny_tokenizer
from tests.tolerances import assert_close
from tests.trainers.grpo_harness import lora_tiny_model, zero_reward
from tests.trainers.rloo_harness import (
    EOS_BIAS,
    build_trainer,
    digit_reward,
    generate_and_score,
    length_reward,
    loss_grads_metrics,
    perturb_adapter,
    rloo_batch,
)
from tests.trainers.step_compare import assert_same_step
from tests.trainers.test_grpo_compat import tiny_moe
from tests.trainers.test_grpo_train_parity import assert_same_curves
from tests.trainers.trainer_cache import TrainerCache

# (case id, config, old_logps spread, accumulation steps)
LOSS_CASES = [
    ("clipped_both_sides", dict(), 0.3, 1),
    ("on_policy", dict(), 0.0, 1),  # old_logps are the current ones: every ratio is 1, nothing clipped
    ("asymmetric_epsilons", dict(epsilon=0.1, epsilon_high=0.4), 0.3, 1),
    ("grad_accumulation", dict(gradient_accumulation_steps=2), 0.3, 2),
]

_trainer_cache: dict[tuple[str, str], object] = TrainerCache()


def _trainers(case_id: str, config: dict):
    """TRL's and slimrl's trainers for a case, built once; slimrl's num_chunks is set per test."""
    for kind in ("trl", "slimrl"):
        if (case_id, kind) not in _trainer_cache:
            _trainer_cache[case_id, kind] = build_trainer(kind, **config)
    return _trainer_cache[case_id, "trl"], _trainer_cache[case_id, "slimrl"]


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("case_id,config,spread,accumulation", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_chunked_loss_matches_trl(case_id, config, spread, accumulation, num_chunks):
    reference, ours = _trainers(case_id, config)
    ours.args.num_chunks = num_chunks
    batch = rloo_batch(reference, ratio_spread=spread)
    expected = loss_grads_metrics(reference, batch, accumulation)
    assert_same_step(expected, loss_grads_metrics(ours, batch, accumulation), f"{case_id}, num_chunks={num_chunks}")
    clipped = expected[2]["clip_ratio/region_mean"]
    assert (clipped == 0.0) if spread == 0 else (0.0 < clipped < 1.0), f"{case_id}: clip fraction {clipped}"


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_eval_loss_and_metrics_match_trl(num_chunks):
    """In eval (no grad, no accumulation) the chunked loss and TRL's eval metrics agree."""
    reference, ours = _trainers("clipped_both_sides", {})
    ours.args.num_chunks = num_chunks
    batch = rloo_batch(reference, seed=2)
    expected = loss_grads_metrics(reference, batch, train=False)
    assert_same_step(expected, loss_grads_metrics(ours, batch, train=False), f"eval, {num_chunks}", train=False)


def test_moe_load_balancing_loss_falls_back_to_trl_and_matches(caplog):
    """The router's auxiliary loss couples all tokens of the micro-batch: TRL's one-piece loss runs, with a warning
    naming the reason, and gives TRL's loss, gradients and metrics (aux_loss included)."""
    reference, ours = (
        build_trainer("trl", model=tiny_moe(), beta=0.0),
        build_trainer("slimrl", model=tiny_moe(), beta=0.0, num_chunks=4),
    )
    batch = rloo_batch(reference)
    expected = loss_grads_metrics(reference, batch)
    with caplog.at_level(logging.WARNING, logger="slimrl.trainers"):
        actual = loss_grads_metrics(ours, batch)
    assert "one piece (TRL's path) because the MoE load-balancing loss" in caplog.text
    assert "aux_loss" in expected[2]
    assert_same_step(expected, actual, "MoE aux loss")


# (case id, config, perturb the trained adapter away from TRL's frozen "ref" copy)
GENERATION_CASES = [
    ("weighted_rewards_no_kl", dict(beta=0.0, reward_weights=[1.0, 0.5]), False),
    (
        "kl_penalty_normalized_clipped_masked",
        dict(beta=0.05, normalize_advantages=True, reward_clip_range=(-0.6, 0.6), mask_truncated_completions=True),
        True,
    ),
    ("steps_per_generation", dict(per_device_train_batch_size=4, steps_per_generation=2, beta=0.05), True),
]


@pytest.mark.parametrize("case_id,config,perturb", GENERATION_CASES, ids=[c[0] for c in GENERATION_CASES])
def test_generated_batch_and_its_loss_match_trl(case_id, config, perturb, monkeypatch):
    """TRL's generation and scoring run through slimrl's trainer unchanged, except that its gradient-free scoring
    passes (old and reference log-probs) run in chunks: same completions, rewards, KL penalty, advantages and
    metrics; then the same loss, gradients and metrics on that batch."""
    settings = dict(reward_funcs=[digit_reward, length_reward], generation_kwargs=EOS_BIAS, max_completion_length=8,
                    **config)  # fmt: skip
    reference, ours = build_trainer("trl", **settings), build_trainer("slimrl", num_chunks=3, **settings)
    if perturb:
        perturb_adapter(reference), perturb_adapter(ours)
    rows_per_forward = {reference: set(), ours: set()}  # of the scoring passes, by trainer
    score = trl.RLOOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        rows_per_forward[self].add(batch_size)
        return score(self, model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)

    monkeypatch.setattr(trl.RLOOTrainer, "_get_per_token_logps_and_entropies", spy)
    expected_batch, expected_metrics = generate_and_score(reference)
    actual_batch, actual_metrics = generate_and_score(ours)
    micro_batch = reference.args.per_device_train_batch_size
    assert rows_per_forward == {reference: {micro_batch}, ours: {-(-micro_batch // 3)}}, "scoring forwards' rows"
    monkeypatch.undo()
    assert actual_batch.keys() == expected_batch.keys()
    for key, value in expected_batch.items():
        assert_close(actual_batch[key], value, "exact" if key.endswith(("_ids", "_mask")) else "fp32", name=key)
    assert actual_metrics.keys() == expected_metrics.keys()
    for name, value in expected_metrics.items():
        assert_close(torch.tensor(actual_metrics[name]), torch.tensor(value), name=f"metric {name}")
    assert expected_batch["advantages"].abs().sum() > 0, "every advantage is zero: nothing to compare"
    if config.get("beta"):
        assert expected_metrics["kl"] != 0.0, "the KL penalty is zero: the reference equals the policy"
    rows = slice(0, micro_batch)
    batch = {key: value[rows] if isinstance(value, torch.Tensor) else value for key, value in expected_batch.items()}
    expected = loss_grads_metrics(reference, batch)
    assert_same_step(expected, loss_grads_metrics(ours, batch), f"{case_id}: loss on the generated batch")


def test_train_curve_matches_trl_with_every_option():
    """LoRA policy, frozen reference adapter with a KL penalty (beta > 0), 2 iterations per generation (so ratios
    move off 1 and clip), gradient accumulation, asymmetric clipping, normalised advantages, truncated-completion
    masking, two weighted reward functions, and TRL's default gradient checkpointing."""
    config = dict(gradient_checkpointing=True, per_device_train_batch_size=4, num_generations=4,
                  gradient_accumulation_steps=2, num_iterations=2, beta=0.04, epsilon_high=0.3,
                  normalize_advantages=True, mask_truncated_completions=True, reward_weights=[1.0, 0.5],
                  reward_funcs=[digit_reward, length_reward], max_steps=3, logging_steps=1, learning_rate=5e-3,
                  seed=7, max_completion_length=8, generation_kwargs=EOS_BIAS)  # fmt: skip
    logs = {}
    for kind, extra in (("trl", {}), ("slimrl", dict(num_chunks=3))):
        trainer = build_trainer(kind, **config, **extra)
        trainer.train()
        logs[kind] = trainer.state.log_history
    assert_same_curves(logs["trl"], logs["slimrl"])
    assert any(entry.get("kl", 0.0) != 0 for entry in logs["trl"]), "the policy never moved off the reference"


def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """3 steps straight == 1 step, checkpoint, resume for 2 more: RLOO's generation buffer (2 iterations per
    generation, so the checkpoint falls inside a buffer's span) comes back with the checkpoint."""
    config = dict(per_device_train_batch_size=4, num_iterations=2, max_steps=3, save_strategy="steps", save_steps=1,
                  logging_steps=1, learning_rate=5e-3, seed=7, max_completion_length=6,
                  reward_funcs=[digit_reward, length_reward], generation_kwargs=EOS_BIAS)  # fmt: skip
    runs = []
    for name, resume in (("straight", None), ("resumed", tmp_path / "straight" / "checkpoint-1")):
        trainer = build_trainer("slimrl", output_dir=str(tmp_path / name), **config)
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
        adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".default." in n}
        runs.append((trainer.state.log_history, adapter))
    (straight_log, straight_adapter), (resumed_log, resumed_adapter) = runs
    # the resumed run's history starts with the checkpoint's (step 1), then logs steps 2 and 3 itself
    assert_same_curves([e for e in straight_log if "loss" in e], [e for e in resumed_log if "loss" in e])
    for name, weight in straight_adapter.items():
        assert_close(resumed_adapter[name], weight, name=name)


def test_constructor_takes_trls_arguments_and_config():
    """TRL's signature, and a plain trl.RLOOConfig gains slimrl's fields at their defaults."""
    ours, theirs = inspect.signature(slimrl.RLOOTrainer.__init__), inspect.signature(trl.RLOOTrainer.__init__)
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == [
        (p.name, p.default, p.kind) for p in theirs.parameters.values()
    ]
    args = trl.RLOOConfig(output_dir="/tmp/slimrl-test-rloo", use_cpu=True, bf16=False, report_to="none",
                          num_generations=4, per_device_train_batch_size=8)  # fmt: skip
    trainer = slimrl.RLOOTrainer(lora_tiny_model(), zero_reward, args, tiny_prompt_dataset(),
                                 processing_class=tiny_tokenizer())  # fmt: skip
    assert (trainer.args.num_chunks, trainer.args.generation_backend) == ("auto", "auto")
    assert trainer.generation_backend == "transformers" or torch.cuda.is_available()


def test_patch_fast_rl_rebinds_trls_rloo_names():
    originals = (trl.RLOOTrainer, trl.RLOOConfig)  # a tuple: a bare name bound to them makes PatchFastRL warn
    slimrl.PatchFastRL("rloo")
    try:
        import trl.trainer.rloo_trainer as rloo_module

        assert trl.RLOOTrainer is slimrl.RLOOTrainer and rloo_module.RLOOTrainer is slimrl.RLOOTrainer
        assert trl.RLOOConfig is slimrl.RLOOConfig
    finally:
        slimrl.unpatch("rloo")
    assert (trl.RLOOTrainer, trl.RLOOConfig) == originals
