"""BCO's loss, running reward shift and metric math (trainers/bco/loss.py) against values worked out by hand."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from slimrl.trainers.bco import loss as bco_loss
from slimrl.trainers.common import unpaired
from tests.tolerances import assert_close


def test_bco_loss_by_hand():
    """beta=0.5, log-ratios 1.2 (thumbs-up) and 1.0 (thumbs-down): rewards r = 0.6 and 0.5; delta = 0.2.
    Thumbs-up: -log sigmoid(0.6 - 0.2) = log(1 + e^-0.4) = log(1.670320046) = 0.5130152524.
    Thumbs-down: -log sigmoid(-(0.5 - 0.2)) = log(1 + e^0.3) = log(2.349858808) = 0.8543552444.
    d/dr of -log sigmoid(r - delta) is -sigmoid(-(r - delta)) = -sigmoid(-0.4) = -0.4013123399; of
    -log sigmoid(-(r - delta)) it is +sigmoid(r - delta) = sigmoid(0.3) = 0.5744425168. The micro-batch's loss is the
    mean, (0.5130152524 + 0.8543552444) / 2 = 0.6836852484."""
    logratios = torch.tensor([1.2, 1.0], requires_grad=True)
    rewards = 0.5 * logratios
    losses = bco_loss.bco_losses(rewards, torch.tensor([True, False]), torch.tensor(0.2))
    assert_close(losses, [0.5130152524, 0.8543552444], name="losses")
    assert_close(losses.mean(), 0.6836852484, name="mean loss")
    rewards.retain_grad()
    losses.sum().backward()
    assert_close(rewards.grad, [-0.4013123399, 0.5744425168], name="d loss / d reward")
    assert_close(logratios.grad, [-0.20065617, 0.28722126], name="d loss / d logratio (beta times the above)")


def test_the_shift_is_constant_for_the_gradient():
    """delta comes from the running mean: a tensor without grad, so only the row's own reward moves its loss."""
    rewards = torch.tensor([0.0, 0.0], requires_grad=True)
    # r = delta: both losses are -log sigmoid(0) = log 2, each gradient is +-sigmoid(0) = +-0.5
    losses = bco_loss.bco_losses(rewards, torch.tensor([True, False]), torch.tensor(0.0))
    losses.sum().backward()
    assert_close(losses, [math.log(2), math.log(2)], name="losses at r = delta")
    assert_close(rewards.grad, [-0.5, 0.5], name="gradients at r = delta")


def test_running_mean_over_every_reward_seen():
    """First batch [1, 3]: the vanishing initial count makes the mean 2, the variance ((1-2)^2 + (3-2)^2) / 2 = 1.
    Second batch [6]: the mean of all three values, 10/3 = 3.333333; the variance of [1, 3, 6]: (1 + 9 + 36) / 3
    - (10/3)^2 = 38/9 = 4.222222; std with Bessel's correction: sqrt(38/9 * 3/2) = sqrt(19/3) = 2.516611. Not an EMA:
    a batch of one value moves the mean by (6 - 2) * 1/3."""
    running = bco_loss.RunningMoments()
    running.update(torch.tensor([1.0, 3.0]))
    assert running.mean == pytest.approx(2.0) and running.var == pytest.approx(1.0)
    assert running.count == pytest.approx(2.0)
    running.update(torch.tensor([6.0]))
    assert running.mean == pytest.approx(10 / 3)
    assert running.var == pytest.approx(38 / 9)
    assert running.std == pytest.approx(2.516611, rel=1e-6)
    assert running.count == pytest.approx(3.0)


def test_running_mean_folds_in_every_processs_rewards():
    """Process A holds [1, 3], process B [6]: A's update, whose sums are reduced with B's, gives the same moments as
    one process holding all three. The reduction's inputs by hand: first (sum, count) = (4, 2) + B's (6, 1); then
    the squared deviations from the global mean 10/3: A's (1-10/3)^2 + (3-10/3)^2 = 49/9 + 1/9, B's (6-10/3)^2 = 64/9.
    """
    calls = []

    def reduce_sum(tensor):
        calls.append(tensor.clone())
        other = torch.tensor([6.0, 1.0]) if len(calls) == 1 else torch.tensor([64 / 9])
        return tensor + other.to(tensor)

    running = bco_loss.RunningMoments()
    running.update(torch.tensor([1.0, 3.0]), reduce_sum)
    assert_close(calls[0], [4.0, 2.0], name="A's (sum, count)")
    assert_close(calls[1], [50 / 9], name="A's squared deviations from the global mean")
    assert running.mean == pytest.approx(10 / 3) and running.var == pytest.approx(38 / 9)
    assert running.count == pytest.approx(3.0)


def test_running_state_round_trips_through_its_dict():
    running = bco_loss.RunningMoments()
    running.update(torch.tensor([0.5, -1.5, 2.0]))
    assert bco_loss.RunningMoments(**running.state_dict()) == running


def test_chunk_stats_and_metrics_by_hand():
    """Two rows: a thumbs-up one (logp -3, reward 0.4, completion tokens at positions 1 and 2 with mean logits 1 and
    3, entropies 2 and 4) and a thumbs-down one (logp -5, reward -0.2, one completion token with mean logit 6, entropy
    1; position 0 is prompt). logits/chosen = (1 + 3) / 2 = 2; logits/rejected = 6; entropy = (2 + 4 + 1) / 3;
    rewards/margins = 0.4 - (-0.2) = 0.6; delta as given."""
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    mean_logits = torch.tensor([[9.0, 1.0, 3.0], [9.0, 9.0, 6.0]])  # the 9s are prompt positions: left out
    entropy = torch.tensor([[9.0, 2.0, 4.0], [9.0, 9.0, 1.0]])
    stats = unpaired.chunk_stats(torch.tensor([-3.0, -5.0]), torch.tensor([0.4, -0.2]), torch.tensor([True, False]),
                                 entropy, mean_logits, mask)  # fmt: skip
    sums = dict(zip(unpaired.STAT_NAMES, stats.tolist(), strict=True))
    sums.update(num_chosen=1.0, num_rejected=1.0, attention_tokens=6.0)
    metrics = defaultdict(list)
    bco_loss.append_metrics(metrics, 0.25, sums, total_train_tokens=6)
    expected = {"delta": 0.25, "entropy": 7 / 3, "num_tokens": 6, "logits/chosen": 2.0, "rewards/chosen": 0.4,
                "logps/chosen": -3.0, "logits/rejected": 6.0, "rewards/rejected": -0.2, "logps/rejected": -5.0,
                "rewards/margins": 0.6}  # fmt: skip
    assert list(metrics) == list(expected)
    for name, value in expected.items():
        assert metrics[name][-1] == pytest.approx(value), name


def test_metrics_of_a_batch_with_one_label_leave_the_other_out():
    sums = dict.fromkeys(unpaired.STAT_NAMES + unpaired.COUNT_NAMES, 0.0)
    sums.update(num_chosen=2.0, chosen_rewards_sum=1.0, chosen_logps_sum=-4.0, chosen_tokens=3.0, entropy_tokens=3.0)
    metrics = defaultdict(list)
    bco_loss.append_metrics(metrics, 0.0, sums, total_train_tokens=0)
    assert "rewards/rejected" not in metrics and "rewards/margins" not in metrics
    assert metrics["rewards/chosen"] == [0.5] and metrics["logps/chosen"] == [-2.0]
