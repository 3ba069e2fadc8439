"""KTO's loss and metric math (trainers/kto/loss.py) and the batch helpers of trainers/kto/trainer.py, against values
worked out by hand."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from slimrl.trainers.common import unpaired
from slimrl.trainers.common.chunked_step import plan_by_length
from slimrl.trainers.kto import loss as kto_loss
from slimrl.trainers.kto.trainer import rows_of, sequence_lengths
from tests.tolerances import assert_close

LOGRATIOS = [2.0, -1.0]  # a desirable row, then an undesirable one
DESIRABLE = [True, False]


def losses_and_grads(loss_type: str, kl: float):
    logratios = torch.tensor(LOGRATIOS, requires_grad=True)
    losses = kto_loss.unpaired_losses(logratios, torch.tensor(DESIRABLE), torch.tensor(kl), 0.5, loss_type)
    losses.sum().backward()
    return losses.detach(), logratios.grad


def test_kto_loss_by_hand():
    """beta=0.5, kl=0.4: desirable 1 - sigmoid(0.5 * (2 - 0.4)) = 1 - sigmoid(0.8); undesirable
    1 - sigmoid(0.5 * (0.4 + 1)) = 1 - sigmoid(0.7). d/dx of 1 - sigmoid(b x) is -b s (1 - s)."""
    losses, grads = losses_and_grads("kto", kl=0.4)
    assert_close(losses, [0.3100255189, 0.3318122278], name="losses")
    assert_close(grads, [-0.1069548483, 0.1108564366], name="d loss / d logratio")


def test_apo_zero_unpaired_loss_by_hand():
    """beta=0.5: desirable 1 - sigmoid(1.0); undesirable sigmoid(-0.5); the KL point plays no part."""
    losses, grads = losses_and_grads("apo_zero_unpaired", kl=123.0)
    assert_close(losses, [0.2689414214, 0.3775406688], name="losses")
    assert_close(grads, [-0.0983059666, 0.1175018561], name="d loss / d logratio")


def test_unknown_loss_type_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"loss_type 'bco' is not a KTO loss slimrl supports; use one of kto, apo"):
        kto_loss.check_loss_type("bco")
    with pytest.raises(ValueError, match=r"'sigmoid'"):
        kto_loss.unpaired_losses(torch.zeros(1), torch.ones(1, dtype=torch.bool), torch.tensor(0.0), 0.1, "sigmoid")


def test_label_weights():
    weights = kto_loss.label_weights(torch.tensor([True, False, True]), 1.5, 0.7, torch.float32)
    assert weights.tolist() == pytest.approx([1.5, 0.7, 1.5])


def test_kl_reference_point_is_a_detached_mean_over_rows_and_processes_never_below_zero():
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.5])  # log-ratios 1.0 and 0.5: mean 0.75
    alone = kto_loss.kl_reference_point(policy, ref, gather=lambda kl: kl.reshape(1))
    assert alone.item() == pytest.approx(0.75) and not alone.requires_grad
    # a second process whose mean is -0.25: (0.75 - 0.25) / 2
    two = kto_loss.kl_reference_point(policy, ref, gather=lambda kl: torch.stack([kl, torch.tensor(-0.25)]))
    assert two.item() == pytest.approx(0.25)
    negative = kto_loss.kl_reference_point(torch.tensor([-3.0, -3.0]), ref, gather=lambda kl: kl.reshape(1))
    assert negative.item() == 0.0  # mean log-ratio -0.75, clamped


def test_chunk_sums_of_the_weighted_loss_are_the_mean_over_the_micro_batch():
    """sum over chunks of sum(w * l) / N is TRL's mean of cat(desirable_weight * desirable losses,
    undesirable_weight * undesirable losses) over the N rows."""
    logratios = torch.tensor([0.3, -1.2, 2.0, 0.0, -0.4, 1.1, 0.8])
    desirable = torch.tensor([True, False, True, True, False, False, True])
    kl = torch.tensor(0.25)
    losses = kto_loss.unpaired_losses(logratios, desirable, kl, 0.2, "kto")
    weights = kto_loss.label_weights(desirable, 1.3, 0.6, torch.float32)
    chunked = sum((weights[rows] * losses[rows]).sum() / len(logratios)
                  for rows in (torch.tensor([0, 4]), torch.tensor([1, 2, 3]), torch.tensor([5, 6])))  # fmt: skip
    by_label = torch.cat([1.3 * losses[desirable], 0.6 * losses[~desirable]])
    assert_close(chunked, by_label.mean(), name="loss")


def test_chunk_stats_by_hand():
    """Three rows over three shifted positions; row 2 is desirable with a NaN reward, which the sums skip (TRL's
    nansum)."""
    stats = unpaired.chunk_stats(
        logps=torch.tensor([-3.0, -5.0, -7.0]),
        rewards=torch.tensor([0.2, -0.4, math.nan]),
        desirable=torch.tensor([True, False, True]),
        entropy=torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]),
        mean_logits=torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]]),
        token_mask=torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 1]]),
    )
    expected = {
        "entropy_sum": 1 + 2 + 5 + 6 + 9,
        "entropy_tokens": 5,
        "chosen_logits_sum": 0.1 + 0.2 + 0.9,
        "chosen_tokens": 3,
        "rejected_logits_sum": 0.5 + 0.6,
        "rejected_tokens": 2,
        "chosen_rewards_sum": 0.2,
        "chosen_logps_sum": -3.0 - 7.0,
        "rejected_rewards_sum": -0.4,
        "rejected_logps_sum": -5.0,
    }
    assert dict(zip(unpaired.STAT_NAMES, stats.tolist(), strict=True)) == pytest.approx(expected)


def sums(**values) -> dict[str, float]:
    return {name: 0.0 for name in unpaired.STAT_NAMES + unpaired.COUNT_NAMES} | values


def test_metrics_by_hand_in_trls_order():
    metrics = defaultdict(list)
    totals = sums(entropy_sum=10.0, entropy_tokens=4, chosen_logits_sum=0.6, chosen_tokens=3, rejected_logits_sum=0.2,
                  rejected_tokens=1, chosen_rewards_sum=0.9, chosen_logps_sum=-30.0, rejected_rewards_sum=-0.4,
                  rejected_logps_sum=-12.0, num_chosen=3, num_rejected=2)  # fmt: skip
    kto_loss.append_metrics(metrics, 0.125, totals, total_train_tokens=57)
    logged = {name: values[-1] for name, values in metrics.items()}
    assert list(logged) == ["kl", "entropy", "num_tokens", "logits/chosen", "logits/rejected", "rewards/chosen",
                            "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins"]  # fmt: skip
    expected = {"kl": 0.125, "entropy": 2.5, "num_tokens": 57, "logits/chosen": 0.2, "logits/rejected": 0.2,
                "rewards/chosen": 0.3, "logps/chosen": -10.0, "rewards/rejected": -0.2, "logps/rejected": -6.0,
                "rewards/margins": 0.5}  # fmt: skip
    assert logged == pytest.approx(expected)


def test_metrics_without_undesirable_rows_or_tokens():
    """No undesirable row: no rejected metrics and no margin (as TRL); no completion token: entropy 0.0."""
    metrics = defaultdict(list)
    kto_loss.append_metrics(metrics, 0.0, sums(chosen_rewards_sum=1.0, chosen_logps_sum=-4.0, num_chosen=2), 0)
    assert dict(metrics) == {"kl": [0.0], "entropy": [0.0], "num_tokens": [0], "rewards/chosen": [0.5],
                             "logps/chosen": [-2.0]}  # fmt: skip


def collated_batch():
    """Two right-padded rows: prompt 2 + completion 3 tokens, prompt 1 + completion 1; KL rows the other way."""
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    completion = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]])
    kl_attention = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    return {
        "input_ids": torch.arange(10).reshape(2, 5) * attention,
        "attention_mask": attention,
        "completion_mask": completion,
        "KL_input_ids": torch.arange(8).reshape(2, 4) * kl_attention,
        "KL_attention_mask": kl_attention,
        "KL_completion_mask": torch.tensor([[0, 0, 1, 0], [0, 1, 1, 1]]),
        "label": torch.tensor([True, False]),
        "ref_logps": torch.tensor([-1.0, -2.0]),
    }


def test_sequence_lengths_are_the_last_attended_column():
    batch = collated_batch()
    assert sequence_lengths(batch, "").tolist() == [5, 2]
    assert sequence_lengths(batch, "KL_").tolist() == [3, 4]


def test_rows_of_cuts_each_family_of_sequences_to_its_own_width():
    batch = collated_batch()
    chunk = plan_by_length(sequence_lengths(batch, ""), 2, min_width=2)[0]  # the shorter row alone
    assert chunk.rows.tolist() == [1] and chunk.width == 2
    part = rows_of(batch, chunk, sequence_lengths(batch, "KL_"))
    assert part["input_ids"].tolist() == [[5, 6]]
    assert part["completion_mask"].tolist() == [[0, 1]]
    assert part["KL_input_ids"].tolist() == [[4, 5, 6, 7]]  # row 1's KL sequence is 4 long
    assert part["label"].tolist() == [False] and part["ref_logps"].tolist() == [-2.0]
