"""KTO's loss and metrics as pure functions over one chunk of sequences.

TRL's KTO loss of a micro-batch of N rows is a mean over its rows of a weighted per-row loss,

    loss = (1 / N) * sum_i w_i * l_i(beta * (logp_i - ref_logp_i), kl)

where w_i is `desirable_weight` or `undesirable_weight` by the row's label and `kl`, KTO's reference point, is one
detached number per micro-batch, estimated from mismatched ("KL") completions. With N and kl fixed before the first
chunk, the micro-batch's loss is the sum over its chunks of `sum_i w_i * l_i / N`: TRL's, up to summation order.

The metrics are sums a chunk contributes to (`common/unpaired.chunk_stats`, shared with BCO), gathered once per
micro-batch and divided as TRL divides them (`append_metrics`). Shapes: b rows in the chunk, t shifted token
positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LOSS_TYPES = ("kto", "apo_zero_unpaired")
KL_FREE_LOSSES = ("apo_zero_unpaired",)  # TRL estimates no KL term (and builds no KL completions) for these

def check_loss_type(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type {loss_type!r} is not a KTO loss slimrl supports; use one of {', '.join(LOSS_TYPES)}."
        )


def unpaired_losses(
    logratios: torch.Tensor,  # [b] policy minus reference completion log-prob
    desirable: torch.Tensor,  # [b] bool
    kl: torch.Tensor,  # scalar, detached (0 for the KL-free losses)
    beta: float,
    loss_type: str,
) -> torch.Tensor:  # [b]
    """Each row's unweighted loss: KTO's Eq. (7) around the reference point `kl`, or APO-zero's unpaired variant."""
    if loss_type == "kto":
        desirable_loss = 1 - F.sigmoid(beta * (logratios - kl))
        undesirable_loss = 1 - F.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        desirable_loss = 1 - F.sigmoid(beta * logratios)
        undesirable_loss = F.sigmoid(beta * logratios)
    else:
        check_loss_type(loss_type)
    return torch.where(desirable, desirable_loss, undesirable_loss)


def label_weights(desirable: torch.Tensor, desirable_weight: float, undesirable_weight: float, dtype) -> torch.Tensor:
    """[b] the weight of each row's loss by its label."""
    weights = torch.full(desirable.shape, undesirable_weight, dtype=dtype, device=desirable.device)
    return weights.masked_fill(desirable, desirable_weight)


def kl_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, gather) -> torch.Tensor:
    """KTO's reference point: the mean log-ratio of the mismatched completions [N] over the micro-batch, averaged
    over processes (`gather`), never below 0; detached (the paper treats it as a constant)."""
    kl = (policy_kl_logps - ref_kl_logps).mean().detach()
    return gather(kl).mean().clamp(min=0)


def append_metrics(metrics: dict[str, list], kl: float, sums: dict[str, float], total_train_tokens: int) -> None:
    """Append the micro-batch's metrics to `metrics` (TRL's per-mode lists) with TRL's names, order and divisions.
    `sums` holds STAT_NAMES and COUNT_NAMES summed over chunks and processes."""
    metrics["kl"].append(kl)
    tokens = sums["entropy_tokens"]
    metrics["entropy"].append(sums["entropy_sum"] / tokens if tokens > 0 else 0.0)
    metrics["num_tokens"] = [total_train_tokens]
    if sums["chosen_tokens"] > 0:
        metrics["logits/chosen"].append(sums["chosen_logits_sum"] / sums["chosen_tokens"])
    if sums["rejected_tokens"] > 0:
        metrics["logits/rejected"].append(sums["rejected_logits_sum"] / sums["rejected_tokens"])
    num_chosen, num_rejected = sums["num_chosen"], sums["num_rejected"]
    if num_chosen > 0:
        metrics["rewards/chosen"].append(sums["chosen_rewards_sum"] / num_chosen)
        metrics["logps/chosen"].append(sums["chosen_logps_sum"] / num_chosen)
    if num_rejected > 0:
        metrics["rewards/rejected"].append(sums["rejected_rewards_sum"] / num_rejected)
        metrics["logps/rejected"].append(sums["rejected_logps_sum"] / num_rejected)
    if num_chosen > 0 and num_rejected > 0:
        metrics["rewards/margins"].append(metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1])
