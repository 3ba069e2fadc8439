"""ppo_math against values worked out by hand (the arithmetic is in the comments). The numbers are dyadic fractions
where possible, so fp32 holds them exactly and the comparisons are exact."""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.trainers.ppo import losses as pm
from tests.tolerances import assert_close

JUNK = 1e6  # what masked positions hold in these tests: it must never reach a result

# -- GAE ------------------------------------------------------------------------------------------------------------

# gamma = lam = 0.5, so gamma * lam = 0.25. Row 0 has 5 real tokens; row 1 has 3, then 2 positions of padding.
GAMMA = LAM = 0.5
REWARDS = torch.tensor([[0.25, -0.5, 0.0, 0.5, 1.0], [0.0, 0.0, 1.0, JUNK, JUNK]])
VALUES = torch.tensor([[0.5, 0.25, 0.75, 0.5, 1.0], [0.5, 0.5, 0.5, JUNK, JUNK]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])

# Row 0, delta_t = r_t + gamma * V_{t+1} - V_t with V_5 = 0 (the episode ends after the last token):
#   delta_4 = 1    + 0.5 * 0    - 1.0  =  0
#   delta_3 = 0.5  + 0.5 * 1.0  - 0.5  =  0.5
#   delta_2 = 0    + 0.5 * 0.5  - 0.75 = -0.5
#   delta_1 = -0.5 + 0.5 * 0.75 - 0.25 = -0.375
#   delta_0 = 0.25 + 0.5 * 0.25 - 0.5  = -0.125
# A_t = delta_t + 0.25 * A_{t+1}:
#   A_4 = 0
#   A_3 = 0.5    + 0.25 * 0        =  0.5
#   A_2 = -0.5   + 0.25 * 0.5      = -0.375
#   A_1 = -0.375 + 0.25 * -0.375   = -0.46875
#   A_0 = -0.125 + 0.25 * -0.46875 = -0.2421875
# returns = A + V = [0.2578125, -0.21875, 0.375, 1.0, 1.0]
# Row 1 (3 real tokens; the value after the last one is 0, whatever position 3 holds):
#   delta_2 = 1 + 0.5 * 0   - 0.5 =  0.5    A_2 =  0.5
#   delta_1 = 0 + 0.5 * 0.5 - 0.5 = -0.25   A_1 = -0.25 + 0.25 * 0.5    = -0.125
#   delta_0 = 0 + 0.5 * 0.5 - 0.5 = -0.25   A_0 = -0.25 + 0.25 * -0.125 = -0.28125
# returns = [0.21875, 0.375, 1.0] and 0 on the padding
HAND_ADVANTAGES = [[-0.2421875, -0.46875, -0.375, 0.5, 0.0], [-0.28125, -0.125, 0.5, 0.0, 0.0]]
HAND_RETURNS = [[0.2578125, -0.21875, 0.375, 1.0, 1.0], [0.21875, 0.375, 1.0, 0.0, 0.0]]


def test_gae_on_a_five_step_example_worked_by_hand():
    advantages, returns = pm.gae(REWARDS, VALUES, MASK, GAMMA, LAM)
    assert_close(advantages, HAND_ADVANTAGES, "exact", name="advantages")
    assert_close(returns, HAND_RETURNS, "exact", name="returns")


def test_gae_with_gamma_and_lambda_one_is_the_reward_to_go_minus_the_value():
    # lam = gamma = 1: A_t = sum_{k>=t} r_k - V_t (the values telescope away)
    advantages, returns = pm.gae(REWARDS, VALUES, MASK, 1.0, 1.0)
    to_go = [[1.25, 1.0, 1.5, 1.5, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0]]
    assert_close(returns, to_go, "exact", name="returns")
    assert_close(advantages, torch.tensor(to_go) - VALUES * MASK, "exact", name="advantages")


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    advantages, _ = pm.gae(REWARDS, VALUES, MASK, GAMMA, 0.0)
    # the deltas of the comments above
    assert_close(advantages, [[-0.125, -0.375, -0.5, 0.5, 0.0], [-0.25, -0.25, 0.5, 0.0, 0.0]], "exact")


# -- per-token rewards: the KL penalty and where the score goes ---------------------------------------------------


def test_kl_penalty_is_per_token_and_the_score_lands_on_the_last_real_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    logps = torch.tensor([[-1.0, -2.0, -0.5, JUNK], [-1.0, -1.0, -1.0, -1.0], [-3.0, JUNK, JUNK, JUNK]])
    ref_logps = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-2.0, -1.0, -1.0, -0.5], [-2.0, 0.0, 0.0, 0.0]])
    scores = torch.tensor([2.0, 3.0, -1.0])
    out = pm.token_rewards(scores, logps, ref_logps, mask, kl_coef=0.5, estimator="k1")
    # k1 = logp - ref on real tokens: row 0 [0.5, -1, 0], row 1 [1, 0, 0, -0.5], row 2 [-1]
    assert_close(out.kl, [[0.5, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, -0.5], [-1.0, 0.0, 0.0, 0.0]], "exact")
    # -0.5 * kl on every real token; the score at the last real token (index 2, 3 and 0)
    assert_close(out.non_score_reward, [[-0.25, 0.5, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.25], [0.5, 0.0, 0.0, 0.0]],
                 "exact")  # fmt: skip
    assert_close(out.rewards, [[-0.25, 0.5, 2.0, 0.0], [-0.5, 0.0, 0.0, 3.25], [-0.5, 0.0, 0.0, 0.0]], "exact")


def test_k3_estimator_by_hand():
    # logp - ref = ln 2, so ref - logp = -ln 2 and k3 = (e^{-ln 2} - 1) - (-ln 2) = 0.5 - 1 + ln 2 = ln 2 - 0.5
    logps = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    assert_close(pm.kl_per_token(logps, ref, "k3"), [[math.log(2) - 0.5]], "fp32")
    assert_close(pm.kl_per_token(logps, ref, "k1"), [[math.log(2)]], "fp32")
    assert pm.kl_per_token(ref, logps, "k3").item() > 0  # k3 is never negative; k1 would be -ln 2 here
    with pytest.raises(ValueError, match="kl_estimator"):
        pm.kl_per_token(logps, ref, "k2")


def test_last_token_index():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert pm.last_token_index(mask).tolist() == [2, 3, 0, 0]


# -- whitening with masks -----------------------------------------------------------------------------------------


def test_whitening_uses_only_the_masked_in_positions():
    values = torch.tensor([[1.0, 2.0, JUNK], [3.0, 4.0, -JUNK]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # real values 1, 2, 3, 4: mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; unbiased var 5 / 3
    assert pm.masked_mean(values, mask).item() == 2.5
    assert_close(pm.masked_var(values, mask), 5 / 3, "fp32")
    assert_close(pm.masked_var(values, mask, unbiased=False), 5 / 4, "fp32")
    scale = 1 / math.sqrt(5 / 3 + 1e-8)
    expected = [[-1.5 * scale, -0.5 * scale, 0.0], [0.5 * scale, 1.5 * scale, 0.0]]
    assert_close(pm.masked_whiten(values, mask), expected, "fp32", name="whitened")
    # shift_mean=False keeps the mean: (x - 2.5) * scale + 2.5; masked positions still 0
    kept = [[-1.5 * scale + 2.5, -0.5 * scale + 2.5, 0.0], [0.5 * scale + 2.5, 1.5 * scale + 2.5, 0.0]]
    assert_close(pm.masked_whiten(values, mask, shift_mean=False), kept, "fp32", name="scaled")
    # what the masked positions hold does not matter, not even NaN or infinity
    other = values.clone()
    other[:, 2] = torch.tensor([math.nan, math.inf], dtype=torch.float64)
    assert_close(pm.masked_whiten(other, mask), expected, "fp32", name="whitened with NaN padding")


def test_an_unbiased_variance_of_one_value_is_an_error():
    with pytest.raises(ValueError, match="at least 2 unmasked values"):
        pm.masked_var(torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0]]))


# -- the clipped policy loss --------------------------------------------------------------------------------------

CLIP = 0.2


def policy_case(ratios: list[float], advantages: list[float]):
    ratio = torch.tensor(ratios, dtype=torch.float64, requires_grad=True)
    terms = pm.clipped_policy_loss(ratio, torch.tensor(advantages, dtype=torch.float64), CLIP)
    terms.loss.sum().backward()
    return terms, ratio.grad


def test_policy_loss_exactly_at_the_clip_boundary_is_not_clipped_and_keeps_its_gradient():
    # r = 1 + eps with A = +1: max(-1.2, -clip(1.2) = -1.2) = -1.2; both sides equal, so not counted as clipped,
    # and the gradient is the unclipped one, -A = -1. Likewise r = 1 - eps with A = -1: loss 0.8, gradient +1.
    terms, grad = policy_case([1.0 + CLIP, 1.0 - CLIP], [1.0, -1.0])
    assert terms.loss.tolist() == [-1.2, 0.8]
    assert terms.clipped.tolist() == [False, False]
    assert grad.tolist() == [-1.0, 1.0]


def test_policy_loss_past_the_boundary():
    # r = 1.3, A = +1: max(-1.3, -1.2) = -1.2, clipped, no gradient (the policy may not gain more)
    # r = 0.7, A = -1: max(0.7, 0.8) = 0.8, clipped, no gradient
    # r = 1.3, A = -1: max(1.3, 1.2) = 1.3, the unclipped (worse) side: gradient -A = +1
    # r = 0.7, A = +1: max(-0.7, -0.8) = -0.7, unclipped: gradient -1
    # r = 1.0, A = 0.5: -0.5 either way, gradient -0.5
    terms, grad = policy_case([1.3, 0.7, 1.3, 0.7, 1.0], [1.0, -1.0, -1.0, 1.0, 0.5])
    assert_close(terms.loss, [-1.2, 0.8, 1.3, -0.7, -0.5], "fp32")
    assert terms.clipped.tolist() == [True, True, False, False, False]
    assert grad.tolist() == [0.0, 0.0, 1.0, -1.0, -0.5]


def test_value_loss_clipping_at_and_past_the_boundary():
    # old V = 0, returns R = 1, eps_v = 0.2. 0.5 * max((V - R)^2, (clip(V, -0.2, 0.2) - R)^2):
    #   V = 0.2 (the boundary): both 0.64 -> 0.32, not clipped, gradient (V - R) = -0.8
    #   V = 0.5: unclipped 0.25, clipped (0.2 - 1)^2 = 0.64 is larger -> 0.32, clipped, no gradient
    #   V = -0.5: unclipped 2.25 beats clipped 1.44 -> 1.125, not clipped, gradient -1.5
    values = torch.tensor([0.2, 0.5, -0.5], dtype=torch.float64, requires_grad=True)
    zeros, ones = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    terms = pm.clipped_value_loss(values, zeros, ones, 0.2)
    terms.loss.sum().backward()
    assert_close(terms.loss, [0.32, 0.32, 1.125], "fp32")
    assert terms.clipped.tolist() == [False, True, False]
    assert_close(values.grad, [-0.8, 0.0, -1.5], "fp32")


# -- the remaining per-token quantities ---------------------------------------------------------------------------


def test_ratio_approx_kl_entropy_and_selected_logprobs():
    logps, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert_close(pm.probability_ratio(logps, old), [[math.exp(0.5), math.exp(-1.0)]], "fp32")
    assert pm.approx_kl(logps, old).tolist() == [[0.125, 0.5]]  # 0.5 * 0.5^2, 0.5 * (-1)^2
    uniform = torch.zeros(1, 2, 4)
    assert_close(pm.entropy_from_logits(uniform), [[math.log(4)] * 2], "fp32")
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]]])
    tokens = torch.tensor([[0, 2]])
    expected = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    assert_close(pm.selected_logprobs(logits, tokens), expected, "fp32")


def test_masked_sum_ignores_nan_in_masked_positions():
    assert pm.masked_sum(torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1, 0, 1])).item() == 3.0
