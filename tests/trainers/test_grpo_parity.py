"""slimrl's chunked GRPO loss against unpatched TRL: same loss, same gradient on every LoRA parameter, same metrics.

Each case builds TRL's trainer and slimrl's on identical weights, feeds both the same generated batch and compares
one compute_loss + backward, for num_chunks 1, 2 and 8 (8 = one sequence per chunk).
"""

from __future__ import annotations

import pytest
import torch

from tests.trainers.grpo_harness import build_trainer, generated_batch, loss_grads_metrics
from tests.trainers.step_compare import assert_same_step
from tests.trainers.trainer_cache import TrainerCache

# (case id, config, batch options, accumulation steps)
CASES = [
    ("grpo", dict(loss_type="grpo"), dict(old_logps=True), 1),
    ("bnpo", dict(loss_type="bnpo"), dict(old_logps=True), 1),
    ("dr_grpo", dict(loss_type="dr_grpo"), dict(old_logps=True), 1),
    ("dapo", dict(loss_type="dapo"), dict(old_logps=True), 1),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.2), dict(old_logps=True), 1),
    ("sapo", dict(loss_type="sapo"), dict(old_logps=True), 1),
    ("luspo", dict(loss_type="luspo", importance_sampling_level="sequence"), dict(old_logps=True), 1),
    ("vespo", dict(loss_type="vespo"), dict(old_logps=True), 1),
    ("on_policy_no_old_logps", dict(loss_type="dapo"), dict(), 1),
    ("grpo_sequence_level", dict(loss_type="grpo", importance_sampling_level="sequence"), dict(old_logps=True), 1),
    ("dapo_sequence_level", dict(loss_type="dapo", importance_sampling_level="sequence"), dict(old_logps=True), 1),
    ("epsilons_and_delta", dict(loss_type="dapo", epsilon=0.1, epsilon_high=0.3, delta=1.2), dict(old_logps=True), 1),
    ("beta_kl", dict(loss_type="grpo", beta=0.04), dict(old_logps=True, ref_logps=True), 1),
    (
        "beta_kl_bias_corrected_sequence",
        dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True, importance_sampling_level="sequence"),
        dict(old_logps=True, ref_logps=True),
        1,
    ),
    ("top_entropy_quantile", dict(loss_type="grpo", top_entropy_quantile=0.5), dict(old_logps=True), 1),
    (
        "entropy_bonus_with_top_entropy",
        dict(loss_type="dapo", entropy_coef=0.05, top_entropy_quantile=0.7),
        dict(old_logps=True),
        1,
    ),
    (
        "adaptive_entropy",
        dict(loss_type="grpo", use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=100.0),
        dict(old_logps=True),
        1,
    ),
    ("off_policy_mask", dict(loss_type="dapo", off_policy_mask_threshold=0.05), dict(old_logps=True), 1),
    ("token_level_advantages", dict(loss_type="bnpo"), dict(old_logps=True, token_advantages=True), 1),
    ("grad_accumulation_grpo", dict(loss_type="grpo", gradient_accumulation_steps=4), dict(old_logps=True), 4),
    (
        "grad_accumulation_dapo_steps_per_generation",
        dict(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4),
        dict(old_logps=True),
        2,
    ),
    ("qwen2_dr_grpo", dict(loss_type="dr_grpo", arch="qwen2"), dict(old_logps=True), 1),
]

_trainer_cache: dict[tuple[str, str], object] = TrainerCache()


def _trainers(case_id: str, config: dict):
    """TRL's and slimrl's trainers for a case, built once; slimrl's num_chunks is set per test."""
    config = dict(config)
    arch = config.pop("arch", "llama")
    pair = []
    for kind in ("trl", "slimrl"):
        key = (case_id, kind)
        if key not in _trainer_cache:
            _trainer_cache[key] = build_trainer(kind, arch=arch, **config)
        pair.append(_trainer_cache[key])
    return pair


@pytest.mark.parametrize("num_chunks", [1, 2, 8])
@pytest.mark.parametrize("case_id,config,batch_options,accumulation", CASES, ids=[c[0] for c in CASES])
def test_chunked_loss_matches_trl(case_id, config, batch_options, accumulation, num_chunks):
    reference, ours = _trainers(case_id, config)
    ours.args.num_chunks = num_chunks
    batch = generated_batch(**batch_options)
    expected = loss_grads_metrics(reference, batch, accumulation)
    actual = loss_grads_metrics(ours, batch, accumulation)
    assert_same_step(expected, actual, f"{case_id}, num_chunks={num_chunks}")


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_vllm_importance_sampling_correction_matches_trl(num_chunks):
    """TRL multiplies the per-token loss by the sampler's importance ratio when vLLM generated the batch."""
    reference, ours = _trainers("vllm_is", dict(loss_type="dapo"))
    batch = generated_batch(old_logps=True)
    batch["importance_sampling_ratio"] = 0.5 + torch.rand(batch["completion_ids"].shape, generator=torch.Generator())
    for trainer in (reference, ours):
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    ours.args.num_chunks = num_chunks
    try:
        expected = loss_grads_metrics(reference, batch)
        actual = loss_grads_metrics(ours, batch)
    finally:
        for trainer in (reference, ours):
            trainer.use_vllm = False
    assert_same_step(expected, actual, f"vllm IS ratio, num_chunks={num_chunks}")


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_eval_loss_and_metrics_match_trl(num_chunks):
    """In eval (no grad, no accumulation) the chunked loss and TRL's eval metrics agree."""
    reference, ours = _trainers("eval", dict(loss_type="grpo", beta=0.04))
    ours.args.num_chunks = num_chunks
    batch = generated_batch(old_logps=True, ref_logps=True)
    expected = loss_grads_metrics(reference, batch, train=False)
    actual = loss_grads_metrics(ours, batch, train=False)
    assert_same_step(expected, actual, f"eval, num_chunks={num_chunks}", train=False)


def test_chunks_beyond_batch_size_are_capped():
    """Asking for more chunks than sequences runs one sequence per chunk, with the same result."""
    reference, ours = _trainers("dapo", dict(loss_type="dapo"))
    ours.args.num_chunks = 64
    batch = generated_batch(old_logps=True)
    assert_same_step(loss_grads_metrics(reference, batch), loss_grads_metrics(ours, batch), "num_chunks=64")


def test_adaptive_entropy_controller_state_matches_trl():
    """The adaptive entropy coefficient moves the same way after an optimizer-step boundary."""
    reference, ours = _trainers("adaptive_entropy", next(c[1] for c in CASES if c[0] == "adaptive_entropy"))
    ours.args.num_chunks = 4
    for trainer in (reference, ours):
        loss_grads_metrics(trainer, generated_batch(old_logps=True))
    assert ours.entropy_coef == pytest.approx(reference.entropy_coef, rel=1e-6)
    assert ours._last_world_entropy == pytest.approx(reference._last_world_entropy, rel=1e-5)
