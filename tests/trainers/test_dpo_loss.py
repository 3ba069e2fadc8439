"""DPO's loss math (slimrl.trainers.dpo.loss) against values worked out by hand on two pairs.

Log-ratios are chosen as logs of small integers so that every sigmoid is a fraction: sigmoid(ln 3) = 3/4,
sigmoid(-ln 3) = 1/4, sigmoid(2 ln 3) = 9/10, sigmoid(0) = 1/2.
"""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.trainers.dpo.loss import (
    PairTerms,
    PreferenceLossSettings,
    chunk_loss,
    f_divergence_scores,
    pair_loss,
    sequence_logps,
    wpo_weights,
)
from tests.tolerances import assert_close

LN3, LN2 = math.log(3), math.log(2)


def terms(chosen, rejected, chosen_tokens=(1.0, 1.0), rejected_tokens=(1.0, 1.0)) -> PairTerms:
    return PairTerms(torch.tensor(chosen), torch.tensor(rejected), torch.tensor(chosen_tokens),
                     torch.tensor(rejected_tokens))  # fmt: skip


def settings(**overrides) -> PreferenceLossSettings:
    return PreferenceLossSettings(**{"beta": 1.0, **overrides})


# (loss type, settings, pair terms, the two pairs' losses worked out by hand)
HAND_CASES = [
    # -log sigmoid(beta * margin): margins ln 3 and 0
    ("sigmoid", settings(), terms([LN3, 0.0], [0.0, 0.0]), [math.log(4 / 3), LN2]),
    # relu(1 - beta * margin), beta 0.5: margin 4 is past the hinge, margin 1 leaves 0.5
    ("hinge", settings(beta=0.5), terms([4.0, 1.0], [0.0, 0.0]), [0.0, 0.5]),
    # (per-token margin - 1/(2 beta))^2, beta 0.25: pair 1 is 6/3 - (-2)/2 = 3, pair 2 is 0/max(0,1) - 4/4 = -1
    ("ipo", settings(beta=0.25), terms([6.0, 0.0], [-2.0, 4.0], (3.0, 0.0), (2.0, 4.0)), [1.0, 9.0]),
    # -log sigmoid(beta * per-token margin): ln 3 (= 2 ln 3 / 2 - 0) and 0
    ("sigmoid_norm", settings(), terms([2 * LN3, 0.0], [0.0, 0.0], (2.0, 1.0)), [math.log(4 / 3), LN2]),
    # KL([q, 1-q] || [1-eps, eps]) with q = sigmoid(margin), eps = 1/4: margin 0 gives q = 1/2;
    # margin ln 3 gives 3/4 ln((3/4)/(3/4)) + 1/4 ln((1/4)/(1/4)) = 0
    (
        "exo_pair",
        settings(label_smoothing=0.25),
        terms([0.0, LN3], [0.0, 0.0]),
        [0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25), 0.0],
    ),
    # (-(1-eps) log sigmoid(m) + eps log sigmoid(-m)) / (1 - 2 eps), eps = 1/4, m = ln 3 and 0
    (
        "robust",
        settings(label_smoothing=0.25),
        terms([LN3, 0.0], [0.0, 0.0]),
        [(-0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / 0.5, (-0.75 * -LN2 + 0.25 * -LN2) / 0.5],
    ),
    # -log s(c) - 1/2 log s(-c) - 1/2 log s(-r), c = ln 3, r = -ln 3; and c = r = 0
    (
        "nca_pair",
        settings(),
        terms([LN3, 0.0], [-LN3, 0.0]),
        [-math.log(0.75) - 0.5 * math.log(0.25) - 0.5 * math.log(0.75), 2 * LN2],
    ),
    # -log s(c) - log s(-r)
    ("bco_pair", settings(), terms([LN3, 0.0], [-LN3, LN3]), [2 * math.log(4 / 3), LN2 + math.log(4)]),
    # (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2, beta 0.5
    ("sppo_hard", settings(beta=0.5), terms([3.0, 1.0], [-2.0, 0.0]), [4.0 + 1.0, 0.0 + 1.0]),
    # 1 - s(c) + s(r)
    ("apo_zero", settings(), terms([LN3, 0.0], [-LN3, 0.0]), [1 - 0.75 + 0.25, 1.0]),
    # s(c) + 1 - s(c - r): c - r = 2 ln 3 -> 9/10
    ("apo_down", settings(), terms([LN3, 0.0], [-LN3, 0.0]), [0.75 + 1 - 0.9, 1.0]),
    # margin 0: blend 1/2 of -log s(0) = ln 2 and exp(0) = 1
    ("discopop", settings(discopop_tau=0.05), terms([0.0, 0.0], [0.0, 0.0]), [0.5 * LN2 + 0.5, 0.5 * LN2 + 0.5]),
]


@pytest.mark.parametrize("loss_type,config,pair_terms,expected", HAND_CASES, ids=[c[0] for c in HAND_CASES])
def test_pair_loss_by_hand(loss_type, config, pair_terms, expected):
    assert_close(pair_loss(loss_type, config, pair_terms), torch.tensor(expected), name=loss_type)


def test_discopop_blend_leans_on_the_exponential_for_large_margins():
    """sigmoid(margin / tau) -> 1 for margin >> tau: the loss is exp(-margin), here exp(-ln 3) = 1/3."""
    loss = pair_loss("discopop", settings(discopop_tau=0.01), terms([LN3, LN3], [0.0, 0.0]))
    assert_close(loss, torch.tensor([1 / 3, 1 / 3]), name="discopop")


@pytest.mark.parametrize(
    "kind,coef,expected",
    [
        ("reverse_kl", 0.5, LN2),
        ("forward_kl", 0.5, 0.5),  # 1 - 1/u at u = 2
        ("js_divergence", 0.5, math.log(4 / 3)),  # log(2u / (1 + u)) at u = 2
        ("alpha_divergence", 0.5, 2 * (1 - 2**-0.5)),  # (u^(a-1) - 1) / (a - 1) at u = 2, a = 1/2
        ("alpha_divergence", 1.0, LN2),  # the limit a -> 1 is log u
    ],
)
def test_f_divergence_score_of_a_doubled_probability(kind, coef, expected):
    config = settings(f_divergence_type=kind, f_alpha_divergence_coef=coef)
    assert_close(f_divergence_scores(torch.tensor([LN2]), config), torch.tensor([expected]), name=kind)


def test_f_divergence_changes_the_sigmoid_margin():
    """forward KL: scores 1 - exp(-ratio): chosen ln 2 -> 1/2, rejected -ln 2 -> -1; margin 3/2."""
    config = settings(f_divergence_type="forward_kl")
    loss = pair_loss("sigmoid", config, terms([LN2, LN2], [-LN2, -LN2]))
    assert_close(loss, torch.full((2,), -math.log(1 / (1 + math.exp(-1.5)))), name="forward_kl sigmoid")


def test_sequence_logps_sum_and_ld_alpha():
    """Pair 0: chosen 2 tokens, rejected 3 (shared 2: the rejected's third counts alpha); pair 1: chosen 3, rejected 1.
    Rows: [chosen 0, chosen 1, rejected 0, rejected 1]; the first column is the prompt (mask 0, log-prob 0)."""
    logps = torch.tensor([[0.0, -1.0, -2.0, 0.0],
                          [0.0, -1.0, -1.0, -4.0],
                          [0.0, -3.0, -1.0, -2.0],
                          [0.0, -5.0, 0.0, 0.0]])  # fmt: skip
    mask = (logps != 0).long()
    assert_close(sequence_logps(logps, mask), torch.tensor([-3.0, -6.0, -6.0, -5.0]), name="sum")
    alpha = 0.25
    expected = torch.tensor([-3.0, -1.0 + alpha * (-1.0 - 4.0), -4.0 + alpha * -2.0, -5.0])
    assert_close(sequence_logps(logps, mask, ld_alpha=alpha), expected, name="ld_alpha")


def test_wpo_weights_are_the_product_of_each_sequence_mean_probability_weight():
    """exp(mean over tokens of log p - log sum p^2) per sequence, multiplied across the pair."""
    logps = torch.tensor([[-1.0, -3.0], [-2.0, 0.0], [-1.0, 0.0], [-4.0, -4.0]])  # rows: chosen 0, 1, rejected 0, 1
    log_sum_sq = torch.tensor([[-1.0, -1.0], [-1.0, 0.0], [-2.0, 0.0], [-3.0, -3.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 1]])
    # means: chosen 0: (0 + -2)/2 = -1; chosen 1: -1; rejected 0: +1; rejected 1: -1
    expected = torch.tensor([math.exp(-1) * math.exp(1), math.exp(-1) * math.exp(-1)])
    weights = wpo_weights(logps.requires_grad_(), log_sum_sq, mask)
    assert_close(weights, expected, name="wpo")
    assert not weights.requires_grad  # constants for the gradient, as in WPO


def test_chunk_loss_weighs_losses_and_divides_by_the_micro_batch():
    """0.5 x sigmoid over B=4 pairs (this chunk holds 2) + 2 x sft over 10 chosen tokens (this chunk's sum -3)."""
    config = settings(loss_types=("sigmoid", "sft"), loss_weights=(0.5, 2.0))
    loss = chunk_loss(config, terms([LN3, 0.0], [0.0, 0.0]), num_pairs=4, chosen_logp_sum=torch.tensor(-3.0),
                      chosen_token_count=torch.tensor(10))  # fmt: skip
    assert_close(loss, torch.tensor(0.5 * (math.log(4 / 3) + LN2) / 4 + 2.0 * 3.0 / 10), name="weighted loss")


def test_chunk_loss_applies_wpo_weights_per_pair():
    config = settings()
    loss = chunk_loss(config, terms([LN3, 0.0], [0.0, 0.0]), num_pairs=2, pair_weights=torch.tensor([2.0, 0.5]))
    assert_close(loss, torch.tensor((2.0 * math.log(4 / 3) + 0.5 * LN2) / 2), name="wpo loss")


def test_chunk_loss_refuses_sft_with_wpo_weights():
    """The SFT term's WPO scaling needs every pair's weight: a chunk cannot compute it."""
    config = settings(loss_types=("sft",), loss_weights=(1.0,))
    with pytest.raises(ValueError, match="whole micro-batch's weights"):
        chunk_loss(config, terms([0.0], [0.0]), 1, torch.ones(1), torch.tensor(-1.0), torch.tensor(1))
