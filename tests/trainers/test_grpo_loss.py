"""grpo_loss against values worked out by hand (the arithmetic is in the comments), not only against TRL: a formula
that moved together with TRL's, or a parity harness that fed both sides the same mistake, still fails here.

The running example: three sequences with completion masks of 4, 2 and 1 tokens (7 tokens in all).
"""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.trainers.grpo.loss import (
    PolicyLossSettings,
    gamma_weights,
    importance_log_weights,
    policy_loss_terms,
    sequence_weights,
    weighted_loss_sum,
)
from tests.tolerances import assert_close

MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])  # lengths 4, 2, 1; N = 3 sequences, 7 tokens


def settings(loss_type: str = "grpo", **changes) -> PolicyLossSettings:
    fields = dict(loss_type=loss_type, importance_sampling_level="token", epsilon_low=0.2, epsilon_high=0.28,
                  delta=None, beta=0.0, use_bias_correction_kl=False, sapo_temperature_pos=1.0,
                  sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                  vespo_lambda_neg=2.0, off_policy_mask_threshold=None, apply_vllm_is_ratio=False)  # fmt: skip
    return PolicyLossSettings(**{**fields, **changes})


# -- sequence weights -----------------------------------------------------------------------------------------------

# loss_type -> the weights of the three sequences, by hand
HAND_WEIGHTS = {
    # mean over sequences of each sequence's token mean: 1 / (N * length_i) = 1/(3*4), 1/(3*2), 1/(3*1)
    "grpo": [1 / 12, 1 / 6, 1 / 3],
    "sapo": [1 / 12, 1 / 6, 1 / 3],
    # one mean over all tokens of the micro-batch: 1 / 7 each
    "bnpo": [1 / 7] * 3,
    # a constant normaliser N * max_completion_length = 3 * 8 = 24
    "dr_grpo": [1 / 24] * 3,
    # divided by the token normaliser (the generation batch's tokens over one accumulation window), here 14
    "dapo": [1 / 14] * 3,
    "cispo": [1 / 14] * 3,
    "vespo": [1 / 14] * 3,
    # a sum of sequence-level terms averaged over the N = 3 sequences
    "luspo": [1 / 3] * 3,
}


@pytest.mark.parametrize("loss_type", sorted(HAND_WEIGHTS))
def test_sequence_weights_by_hand(loss_type):
    weights = sequence_weights(loss_type, MASK, max_completion_length=8, token_normalizer=torch.tensor(14.0))
    assert weights.dtype == torch.float32
    assert_close(weights, torch.tensor(HAND_WEIGHTS[loss_type]), name=f"{loss_type} weights")


@pytest.mark.parametrize(
    "loss_type,total",
    [
        ("grpo", 1.0),  # (4 * 1/12) + (2 * 1/6) + (1 * 1/3) = 1/3 + 1/3 + 1/3: every sequence's mean counts alike
        ("bnpo", 1.0),  # 7 tokens * 1/7
        ("dr_grpo", 7 / 24),  # 7 tokens * 1/24
        ("dapo", 0.5),  # 7 tokens * 1/14
        ("luspo", 7 / 3),  # 7 tokens * 1/3: a sum per sequence, not a mean
    ],
)
def test_a_per_token_loss_of_one_sums_to_the_normalised_token_count(loss_type, total):
    weights = sequence_weights(loss_type, MASK, max_completion_length=8, token_normalizer=torch.tensor(14.0))
    ones = torch.ones(MASK.shape)  # padding positions would add 1 each if the mask were not applied
    assert weighted_loss_sum(ones, MASK, weights).item() == pytest.approx(total, rel=1e-6)


def test_an_empty_completion_counts_as_one_token_for_grpo():
    mask = torch.tensor([[1, 1], [0, 0]])  # N = 2: 1 / (2 * 2) and 1 / (2 * max(0, 1))
    assert_close(sequence_weights("grpo", mask, max_completion_length=2, token_normalizer=None),
                 torch.tensor([1 / 4, 1 / 2]))  # fmt: skip


def test_unknown_loss_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="slimrl supports grpo, bnpo"):
        sequence_weights("ppo", MASK, max_completion_length=8, token_normalizer=None)


# -- per-token policy terms of the clipped losses -----------------------------------------------------------------

# Ratios r = exp(logp - old_logp) per token. Row 0 has advantage +1, row 1 advantage -1, both with r = 0.5 (below the
# low clip 1 - 0.2 = 0.8), 1.0, and 2.0 (above the high clip 1 + 0.28 = 1.28); row 2 (advantage +0.5) sits on the
# boundaries: r = 0.8, 1.28, 1.0.
RATIOS = torch.tensor([[0.5, 1.0, 2.0], [0.5, 1.0, 2.0], [0.8, 1.28, 1.0]])
ADVANTAGES = torch.tensor([[1.0], [-1.0], [0.5]])
FULL = torch.ones(3, 3)


def clipped_terms(**changes):
    logps = torch.full((3, 3), -1.0, requires_grad=True)
    old = logps.detach() - torch.log(RATIOS)  # logp - old = log r
    terms = policy_loss_terms(settings("grpo", **changes), logps, old, ADVANTAGES, FULL)
    terms.per_token_loss.sum().backward()
    return terms, logps.grad


def test_clipped_loss_at_and_beyond_the_clip_boundaries_by_hand():
    terms, grad = clipped_terms()
    # loss = -min(r * A, clip(r, 0.8, 1.28) * A)
    expected = torch.tensor([
        # A = +1: -min(0.5, 0.8) = -0.5; -min(1, 1) = -1; -min(2, 1.28) = -1.28 (clipped: the ratio cannot push on)
        [-0.5, -1.0, -1.28],
        # A = -1: -min(-0.5, -0.8) = 0.8 (clipped); -min(-1, -1) = 1; -min(-2, -1.28) = 2 (a bad ratio is not clipped)
        [0.8, 1.0, 2.0],
        # A = 0.5 on the boundaries: -0.5 * 0.8 = -0.4; -0.5 * 1.28 = -0.64; -0.5 * 1 = -0.5
        [-0.4, -0.64, -0.5],
    ])  # fmt: skip
    assert_close(terms.per_token_loss, expected, name="per-token loss")
    assert_close(terms.coef_1, RATIOS, name="ratio")  # no delta: the ratio the clip metrics read is r itself
    # d loss / d logp = -A * r where the unclipped branch is taken (d r / d logp = r), 0 where the clip holds:
    # row 0: -0.5, -1, 0 (clipped); row 1: 0 (clipped), 1, 2. Row 2 sits on the boundaries (the branch is a tie).
    assert_close(grad[:2], torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 2.0]]), name="gradient")
    assert terms.per_token_kl is None and terms.phi_seq is None


def test_two_sided_clipping_caps_the_ratio_of_negative_advantages_at_delta():
    terms, grad = clipped_terms(delta=1.5)
    # kept ratio = min(r, 1.5); only row 1's r = 2 changes: -min(-1 * 1.5, -1.28) = 1.5, and its gradient is 0
    # (the cap is constant in r); row 0's r = 2 stays clipped at 1.28 by the ordinary clip
    assert_close(terms.per_token_loss[:2], torch.tensor([[-0.5, -1.0, -1.28], [0.8, 1.0, 1.5]]), name="loss")
    assert_close(grad[:2], torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 0.0]]), name="gradient")
    assert_close(terms.coef_1[:2], torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]), name="kept ratio")


def test_cispo_weights_the_log_prob_by_the_capped_detached_ratio():
    logps = torch.tensor([[-0.5, -0.5]], requires_grad=True)
    old = logps.detach() - torch.log(torch.tensor([[2.0, 8.0]]))  # r = 2 and 8
    terms = policy_loss_terms(settings("cispo", epsilon_high=5.0), logps, old, torch.tensor([[1.0]]), torch.ones(1, 2))
    terms.per_token_loss.sum().backward()
    # loss = -min(r, 5) * A * logp: -(2)(1)(-0.5) = 1; -(5)(1)(-0.5) = 2.5; gradient -min(r, 5) * A = -2, -5
    assert_close(terms.per_token_loss, torch.tensor([[1.0, 2.5]]), name="loss")
    assert_close(logps.grad, torch.tensor([[-2.0, -5.0]]), name="gradient")


def test_sapo_on_policy_is_the_plain_policy_gradient():
    logps = torch.tensor([[-1.0], [-1.0]], requires_grad=True)
    advantages = torch.tensor([[2.0], [-1.0]])
    terms = policy_loss_terms(settings("sapo"), logps, logps.detach(), advantages, torch.ones(2, 1))
    terms.per_token_loss.sum().backward()
    # r = 1: loss = -sigmoid(tau * 0) * 4 / tau * A = -2 A / tau
    #   A = 2 (tau = 1): -4;  A = -1 (tau = 1.05): 2 / 1.05
    assert_close(terms.per_token_loss, torch.tensor([[-4.0], [2 / 1.05]]), name="loss")
    # gradient: -sigmoid'(0) * tau * r * 4 / tau * A = -0.25 * 4 * A = -A, whatever tau
    assert_close(logps.grad, torch.tensor([[-2.0], [1.0]]), name="gradient")


def test_sequence_level_ratio_is_the_masked_mean_of_the_log_ratios():
    log_ratio = torch.tensor([[math.log(2.0), math.log(2.0), 5.0], [math.log(0.5), math.log(2.0), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: (log 2 + log 2) / 2 = log 2 (the padded 5.0 is ignored); row 1: (log 0.5 + log 2 + 0) / 3 = 0
    weights = importance_log_weights("sequence", log_ratio, mask)
    assert_close(weights.exp(), torch.tensor([[2.0], [1.0]]), name="sequence ratio")
    assert importance_log_weights("token", log_ratio, mask) is log_ratio
    with pytest.raises(ValueError, match="use 'token' or 'sequence'"):
        importance_log_weights("group", log_ratio, mask)


def test_k3_kl_term_and_its_beta():
    logps = torch.zeros(1, 2)
    ref = torch.tensor([[0.0, math.log(2.0)]])
    terms = policy_loss_terms(
        settings("grpo", beta=0.1), logps, logps, torch.zeros(1, 1), torch.ones(1, 2), ref_logps=ref
    )
    # k3 = exp(d) - d - 1 with d = ref - logp: d = 0 -> 0; d = log 2 -> 2 - 0.693147 - 1 = 0.306853
    assert_close(terms.per_token_kl, torch.tensor([[0.0, 1.0 - math.log(2.0)]]), name="kl")
    # A = 0: the policy term is -min(0, 0) = 0, so the loss is beta * kl
    assert_close(terms.per_token_loss, 0.1 * terms.per_token_kl, name="loss")


def test_vespo_weight_is_one_on_policy():
    # phi(w) = exp(lambda + k log w - lambda w); on policy w = 1: exp(lambda + 0 - lambda) = 1 for either sign of A
    phi = gamma_weights(settings("vespo"), torch.tensor([[1.0], [-1.0]]), torch.zeros(2, 3), torch.ones(2, 3), None)
    assert_close(phi, torch.ones(2, 1), name="phi")


def test_off_policy_mask_drops_negative_sequences_that_drifted_from_the_sampler():
    from slimrl.trainers.grpo.loss import off_policy_mask

    logps = torch.zeros(3, 2)
    sampling = torch.tensor([[0.1, 0.3], [0.1, 0.1], [2.0, 2.0]])  # per-token KL estimate: sampling - logp
    advantages = torch.tensor([[-1.0], [-1.0], [1.0]])
    # mean KL 0.2 > 0.15 with A < 0: dropped; 0.1 <= 0.15: kept; 2.0 but A >= 0: kept
    kept = off_policy_mask(advantages, logps, sampling, torch.ones(3, 2), threshold=0.15)
    assert kept.tolist() == [[0.0], [1.0], [1.0]]
