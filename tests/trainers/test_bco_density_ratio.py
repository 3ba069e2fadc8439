"""BCO's density-ratio matching math (trainers/bco/density_ratio.py, loss.bco_losses' weights) against values worked
out by hand: the balanced, L2-penalised logistic regression on a 1-D example, the clamped density-ratio weights, and
the weighted loss of a few rows."""

from __future__ import annotations

import math

import pytest
import torch

from slimrl.trainers.bco import density_ratio
from slimrl.trainers.bco.loss import bco_losses
from tests.tolerances import assert_close

# Thumbs-up prompts at x = +1 (six) and -1 (two, the noise); thumbs-down at -1 (three) and +1 (one, the noise).
UP = [1.0] * 6 + [-1.0] * 2
DOWN = [-1.0] * 3 + [1.0]
# By hand. n = 12; balanced class weights n / (2 n_c): 12 / 16 = 0.75 per thumbs-up row, 12 / 8 = 1.5 per
# thumbs-down row. With sp(z) = log(1 + e^z) and z = w x + b, the objective is
#   f = 0.75 (6 sp(-(w + b)) + 2 sp(-(-w + b))) + 1.5 (3 sp(-w + b) + sp(w + b)) + w^2 / 2
#     = 4.5 sp(-w - b) + 1.5 sp(w - b) + 4.5 sp(-w + b) + 1.5 sp(w + b) + w^2 / 2.
# Swapping x -> -x and the labels maps the data onto itself, and f is strictly convex: b = 0 (check: df/db at b = 0
# is -4.5 s(-w) - 1.5 s(w) + 4.5 s(-w) + 1.5 s(w) = 0, s the sigmoid). At b = 0,
#   df/dw = -9 s(-w) + 3 s(w) + w = 12 s(w) - 9 + w = 0,
# solved by Newton's method on h(w) = w + 12 s(w) - 9, h' = 1 + 12 s(w) (1 - s(w)), from w = 0.7:
#   h(0.7) = -0.281747 -> w = 0.776968; h = -0.0027155 -> w = 0.777725; h = -2.7e-7 -> w = 0.7777249698.
# (Without the penalty the fit would match the weighted counts at x = 1: six thumbs-up rows of weight 0.75 against one
# thumbs-down row of weight 1.5, odds e^w = 4.5 / 1.5 = 3, w = ln 3 = 1.0986: the penalty shrinks it.)
W = 0.7777249698
# The density ratio at x is the classifier's odds s(w x) / (1 - s(w x)) = e^(w x):
#   x = -1: e^-0.77772 = 0.45945 -> clamped up to min_density_ratio 0.5; x = 0: 1; x = 1: e^0.77772 = 2.1765150;
#   x = 3: e^2.33317 = 10.3106 -> clamped down to max_density_ratio 10.
RATIOS = [0.5, 1.0, 2.1765149914, 10.0]


def one_d(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)[:, None]


def labels(up: int, down: int) -> torch.Tensor:
    return torch.tensor([True] * up + [False] * down)


def test_balanced_logistic_regression_by_hand():
    classifier = density_ratio.fit_density_ratio_classifier(one_d(UP + DOWN), labels(8, 4))
    assert_close(classifier.weight, [W], name="w")
    assert classifier.bias == pytest.approx(0.0, abs=1e-9)
    # p(thumbs-up | x = 1) = s(0.7777250) = 0.6851896; at x = -1 the complement
    assert_close(classifier.prob_desirable(one_d([1.0, -1.0])), [0.6851895858, 0.3148104142], name="p(up | x)")
    # training accuracy as TRL logged it: the 6 of 8 thumbs-up rows at x = 1 and the 3 of 4 thumbs-down at -1
    assert classifier.accuracy(one_d(UP), True) == pytest.approx(0.75)
    assert classifier.accuracy(one_d(DOWN), False) == pytest.approx(0.75)


def test_thumbs_down_weights_are_the_clamped_density_ratio_and_thumbs_up_weigh_one():
    classifier = density_ratio.fit_density_ratio_classifier(one_d(UP + DOWN), labels(8, 4))
    x = one_d([-1.0, 0.0, 1.0, 3.0])
    prob = classifier.prob_desirable(x)
    down = density_ratio.udm_weights(prob, torch.zeros(4, dtype=torch.bool), min_ratio=0.5, max_ratio=10.0)
    assert_close(down, RATIOS, name="thumbs-down weights")
    up = density_ratio.udm_weights(prob, torch.ones(4, dtype=torch.bool), min_ratio=0.5, max_ratio=10.0)
    assert_close(up, [1.0] * 4, "exact", name="thumbs-up weights")
    # narrower clamps: e^(w x) for x = 0 and 1 (1 and 2.18) lands on [1.5, 2]'s ends
    narrow = density_ratio.udm_weights(prob, torch.zeros(4, dtype=torch.bool), min_ratio=1.5, max_ratio=2.0)
    assert_close(narrow, [1.5, 1.5, 2.0, 2.0], name="weights clamped to [1.5, 2]")


@pytest.mark.parametrize("dim", [2, 20])
def test_the_fit_is_the_same_along_any_direction_of_any_dimension(dim):
    """The 1-D example laid along the unit vector u = (0.6, 0.8, 0, ...): the penalty ||w||^2 and the scores w . x
    only see w's component along u, so the optimum is w = 0.7777250 u, b = 0. dim 20 > 12 rows takes the fit's
    reduction to the span of the rows; dim 2 does not."""
    u = torch.zeros(dim, dtype=torch.float64)
    u[:2] = torch.tensor([0.6, 0.8])
    classifier = density_ratio.fit_density_ratio_classifier(one_d(UP + DOWN) * u, labels(8, 4))
    assert_close(classifier.weight, W * u, name="w")
    assert classifier.bias == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(("embeddings", "desirable", "message"), [
    (one_d(UP), labels(8, 0), r"needs thumbs-up and thumbs-down prompts; got 8 thumbs-up and 0 thumbs-down"),
    (one_d(DOWN), labels(0, 4), r"got 0 thumbs-up and 4 thumbs-down"),
    (one_d(UP[:-1] + [math.nan] + DOWN), labels(8, 4), r"not finite"),
    (one_d(UP + DOWN), labels(8, 3), r"one \[n, d\] embedding per label"),
])  # fmt: skip
def test_a_classifier_that_cannot_be_fit_says_why(embeddings, desirable, message):
    with pytest.raises(density_ratio.ClassifierFitError, match=message):
        density_ratio.fit_density_ratio_classifier(embeddings, desirable)


def test_weighted_bco_loss_by_hand():
    """Three rows, delta = 0.2: a thumbs-up one with r = 0.6 (weight 1), thumbs-down ones with r = 0.5 (weight 2)
    and r = -0.1 (weight 0.5).
      thumbs-up:     -log s(0.6 - 0.2)    = log(1 + e^-0.4) = 0.5130152524
      thumbs-down 1: -log s(-(0.5 - 0.2)) = log(1 + e^0.3)  = 0.8543552445, times 2 = 1.7087104889
      thumbs-down 2: -log s(-(-0.1 - 0.2)) = log(1 + e^-0.3) = 0.5543552445, times 0.5 = 0.2771776222
    TRL's loss is the plain mean over the rows, weights not normalised: (0.5130152524 + 1.7087104889 + 0.2771776222)
    / 3 = 0.8329677879 (unweighted it would be 0.6405752471). d loss / d r: -s(-0.4) / 3 = -0.1337707800;
    2 s(0.3) / 3 = 0.3829616779; 0.5 s(-0.3) / 3 = 0.0709262472."""
    rewards = torch.tensor([0.6, 0.5, -0.1], requires_grad=True)
    desirable, weights = torch.tensor([True, False, False]), torch.tensor([1.0, 2.0, 0.5])
    losses = bco_losses(rewards, desirable, torch.tensor(0.2), weights)
    assert_close(losses, [0.5130152524, 1.7087104889, 0.2771776222], name="weighted losses")
    loss = losses.mean()
    assert_close(loss, 0.8329677879, name="loss")
    assert_close(bco_losses(rewards, desirable, torch.tensor(0.2)).mean(), 0.6405752471, name="unweighted loss")
    loss.backward()
    assert_close(rewards.grad, [-0.1337707800, 0.3829616779, 0.0709262472], name="d loss / d reward")
