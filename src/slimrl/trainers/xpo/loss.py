"""XPO's loss from the summed completion log-probs of each pair, as pure functions.

A pair is one prompt's two completions: the policy's sample y and the reference model's sample y'. The reward
functions rank them (y wins ties); the DPO loss takes the policy's log-ratio margin of chosen over rejected against
the reference's; XPO adds `alpha * log pi(y'|x)`, the policy's summed log-probability of the reference's sample.
Minimising it lowers the policy's probability of what the reference would say (the paper's exploration bonus:
move off the reference's support). TRL's last XPOTrainer: loss = mean over pairs of (dpo + xpo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimrl.trainers.online_dpo.step import pair_losses

__all__ = ["XPOTerms", "chosen_and_rejected", "xpo_terms"]


@dataclass(frozen=True)
class XPOTerms:
    """Every per-pair quantity XPO's loss and stats read, [b] each."""

    dpo: torch.Tensor  # the DPO loss of the pair
    xpo: torch.Tensor  # alpha * the policy's log-prob of the reference's completion
    chosen_logps: torch.Tensor  # the policy's summed log-probs of the chosen completion
    rejected_logps: torch.Tensor
    chosen_ref_logps: torch.Tensor  # the reference model's, of the same completions
    rejected_ref_logps: torch.Tensor


def chosen_and_rejected(on_policy_sample: torch.Tensor, on_reference_sample: torch.Tensor,
                        policy_chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(chosen, rejected) [b] of a per-pair value given on each of the two samples [b], by which one won [b] bool."""
    return (torch.where(policy_chosen, on_policy_sample, on_reference_sample),
            torch.where(policy_chosen, on_reference_sample, on_policy_sample))  # fmt: skip


def xpo_terms(policy_logps: torch.Tensor, reference_logps: torch.Tensor, policy_chosen: torch.Tensor, beta: float,
              alpha: float, loss_type: str) -> XPOTerms:  # fmt: skip
    """The pair terms of XPO.

    policy_logps, reference_logps: [b, 2] summed completion log-probs under the policy and under the reference
    model, column 0 of the policy's sample, column 1 of the reference's. policy_chosen: [b] bool, the policy's sample
    won the ranking. loss_type: "sigmoid" or "ipo" (online DPO's pair losses)."""
    chosen_logps, rejected_logps = chosen_and_rejected(policy_logps[:, 0], policy_logps[:, 1], policy_chosen)
    chosen_ref, rejected_ref = chosen_and_rejected(reference_logps[:, 0], reference_logps[:, 1], policy_chosen)
    margins = (chosen_logps - chosen_ref) - (rejected_logps - rejected_ref)  # [b]
    dpo = pair_losses(margins, beta, loss_type)
    xpo = alpha * policy_logps[:, 1]  # the gradient flows through the policy's log-prob of the reference's sample
    return XPOTerms(dpo, xpo, chosen_logps, rejected_logps, chosen_ref, rejected_ref)
