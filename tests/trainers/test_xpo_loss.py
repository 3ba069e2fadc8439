"""XPO's pair math (trainers/xpo/loss.py) and its config's alpha, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.trainers.xpo.config import XPOConfig, checked_alpha
from slimrl.trainers.xpo.loss import chosen_and_rejected, xpo_terms
from tests.tolerances import assert_close

# Two pairs; column 0 is the policy's sample, column 1 the reference model's.
POLICY_LOGPS = [[-2.0, -3.0], [-1.0, -4.0]]  # the policy's summed log-probs of each sample
REFERENCE_LOGPS = [[-2.5, -3.0], [-1.0, -3.0]]  # the reference model's
POLICY_CHOSEN = [True, False]  # pair 0: the policy's sample won; pair 1: the reference's
BETA, ALPHA = 0.5, 0.1
# Pair 0: chosen = policy's sample, log-ratio -2 - (-2.5) = 0.5; rejected = reference's sample, -3 - (-3) = 0;
#         margin 0.5. Pair 1: chosen = reference's sample, -4 - (-3) = -1; rejected = policy's, -1 - (-1) = 0;
#         margin -1. The exploration term is alpha times the policy's log-prob of the reference's sample:
#         0.1 * -3 = -0.3 and 0.1 * -4 = -0.4.
XPO = [-0.3, -0.4]


def terms_and_grads(loss_type: str, alpha: float = ALPHA):
    policy = torch.tensor(POLICY_LOGPS, requires_grad=True)
    terms = xpo_terms(policy, torch.tensor(REFERENCE_LOGPS), torch.tensor(POLICY_CHOSEN), BETA, alpha, loss_type)
    (terms.dpo + terms.xpo).mean().backward()
    return terms, policy.grad


def test_sigmoid_xpo_loss_by_hand():
    """DPO: -log sigmoid(beta * margin) = log(1 + exp(-beta * margin)): log(1 + e^-0.25) = 0.5759394199 and
    log(1 + e^0.5) = 0.9740769842. Loss = mean(0.5759394199 - 0.3, 0.9740769842 - 0.4) = 0.4250082020.
    Gradient of the mean over 2 pairs: d/d margin of the pair loss is -beta * sigmoid(-beta * margin), so
    pair 0 (chosen = column 0): column 0 gets -0.5 * sigmoid(-0.25) / 2 = -0.1094558748, column 1 the opposite
    plus alpha / 2: 0.1094558748 + 0.05 = 0.1594558748; pair 1 (chosen = column 1): column 1 gets
    -0.5 * sigmoid(0.5) / 2 + 0.05 = -0.1556148328 + 0.05 = -0.1056148328, column 0 +0.1556148328."""
    terms, grads = terms_and_grads("sigmoid")
    assert_close(terms.dpo, [math.log(1 + math.exp(-0.25)), math.log(1 + math.exp(0.5))], name="dpo")
    assert_close(terms.dpo, [0.5759394199, 0.9740769842], name="dpo (decimals)")
    assert_close(terms.xpo, XPO, name="xpo")
    assert_close((terms.dpo + terms.xpo).mean(), 0.4250082020, name="loss")
    assert_close(grads, [[-0.1094558748, 0.1594558748], [0.1556148328, -0.1056148328]], name="d loss / d logps")


def test_ipo_xpo_loss_by_hand():
    """IPO: (margin - 1 / (2 beta))^2 = (0.5 - 1)^2 = 0.25 and (-1 - 1)^2 = 4; its derivative 2 (margin - 1) is -1
    and -4, over 2 pairs -0.5 and -2: pair 0 column 0 -0.5, column 1 0.5 + 0.05; pair 1 column 1 -2 + 0.05,
    column 0 2."""
    terms, grads = terms_and_grads("ipo")
    assert_close(terms.dpo, [0.25, 4.0], name="dpo")
    assert_close(terms.xpo, XPO, name="xpo")
    assert_close(grads, [[-0.5, 0.55], [2.0, -1.95]], name="d loss / d logps")


def test_chosen_and_rejected_sides_and_their_log_probs():
    """Pair 0 chose column 0, pair 1 column 1: the policy's chosen log-probs are -2 and -4, rejected -3 and -1;
    the reference model's chosen -2.5 and -3, rejected -3 and -1."""
    terms, _ = terms_and_grads("sigmoid")
    assert_close(terms.chosen_logps, [-2.0, -4.0], name="chosen")
    assert_close(terms.rejected_logps, [-3.0, -1.0], name="rejected")
    assert_close(terms.chosen_ref_logps, [-2.5, -3.0], name="chosen (reference)")
    assert_close(terms.rejected_ref_logps, [-3.0, -1.0], name="rejected (reference)")
    chosen, rejected = chosen_and_rejected(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]),
                                           torch.tensor([False, True]))  # fmt: skip
    assert chosen.tolist() == [3.0, 2.0] and rejected.tolist() == [1.0, 4.0]


def test_alpha_zero_leaves_the_dpo_loss():
    """alpha=0: no exploration term, and the gradient is DPO's alone (the sigmoid case's without the +0.05)."""
    terms, grads = terms_and_grads("sigmoid", alpha=0.0)
    assert terms.xpo.tolist() == [0.0, 0.0]
    assert_close(grads, [[-0.1094558748, 0.1094558748], [0.1556148328, -0.1556148328]], name="d loss / d logps")


def test_alpha_takes_a_float_or_one_per_epoch():
    """TRL's XPOConfig: default 1e-5; a one-element list becomes its float; a longer list stays a schedule."""
    assert XPOConfig("/tmp/slimrl-test-xpo", report_to="none").alpha == 1e-5
    assert checked_alpha([0.5]) == 0.5 and checked_alpha(2) == 2.0
    assert checked_alpha([0.1, 0.01]) == [0.1, 0.01]
    for bad in ([], [float("nan")], "0.1", [0.1, None]):
        with pytest.raises(ValueError, match="alpha"):
            checked_alpha(bad)
