"""DPO's loss as plain functions of one chunk of preference pairs: the formulas of TRL 1.16's DPOTrainer, arranged so
that a micro-batch's loss is the sum of its chunks' losses.

Shapes: a chunk holds b pairs as 2b rows, its b chosen sequences first and then their b rejected ones in the same
order (TRL's [chosen; rejected] layout); t is the chunk's number of label columns (its width minus one).

Every loss type but two is a mean over pairs of a per-pair term, so a chunk contributes `sum(terms) / B` with B the
micro-batch's number of pairs. "sft" is a mean over the micro-batch's chosen tokens, so a chunk contributes its
chosen tokens' negative log-prob sum over the micro-batch's chosen-token count. "aot" and "aot_unpaired" sort the
log-ratios of the whole micro-batch and cannot be split: the trainer runs those in one piece (TRL's code).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Losses whose micro-batch value is a mean over pairs of a per-pair term (plus "sft", a token mean): chunkable.
PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
               "apo_down", "discopop", "sigmoid_norm")  # fmt: skip
TOKEN_MEAN_LOSSES = ("sft",)
CHUNKABLE_LOSSES = PAIR_LOSSES + TOKEN_MEAN_LOSSES
BATCH_SORTED_LOSSES = ("aot", "aot_unpaired")  # sort across the micro-batch: one piece only
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass(frozen=True)
class PreferenceLossSettings:
    """The options DPO's loss reads, taken from a trainer (or written out in tests)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05

    @classmethod
    def from_trainer(cls, trainer) -> PreferenceLossSettings:
        return cls(
            loss_types=tuple(trainer.loss_types),
            loss_weights=tuple(trainer.loss_weights),
            beta=trainer.beta,
            label_smoothing=trainer.label_smoothing,
            f_divergence_type=trainer.f_divergence_type,
            f_alpha_divergence_coef=trainer.f_alpha_divergence_coef,
            discopop_tau=trainer.args.discopop_tau,
        )


@dataclass(frozen=True)
class PairTerms:
    """Per-pair quantities of one chunk, each [b]."""

    chosen_logratios: torch.Tensor  # log pi(chosen) - log ref(chosen), summed over the completion
    rejected_logratios: torch.Tensor
    chosen_tokens: torch.Tensor  # completion tokens of the unshifted completion mask (what ipo/sigmoid_norm divide by)
    rejected_tokens: torch.Tensor


def sequence_logps(per_token_logps: torch.Tensor, mask: torch.Tensor, ld_alpha: float | None = None) -> torch.Tensor:
    """Per-sequence log-probs [2b] from per-token ones [2b, t] (zero off the completion) and the label mask [2b, t].

    With `ld_alpha` (LD-DPO), a sequence's tokens past the length its pair partner shares with it count `ld_alpha`
    times: both sequences of a pair are weighed over the same number of full-weight tokens."""
    if ld_alpha is None:
        return per_token_logps.sum(dim=1)
    position = mask.cumsum(dim=1)  # [2b, t] 1-based index of each completion token, 0 before the completion
    lengths = mask.sum(dim=1)  # [2b]
    chosen_lengths, rejected_lengths = lengths.chunk(2)
    shared = torch.minimum(chosen_lengths, rejected_lengths).repeat(2).unsqueeze(1)  # [2b, 1]
    in_shared = (position > 0) & (position <= shared)  # [2b, t]
    in_tail = position > shared
    return (per_token_logps * in_shared).sum(dim=1) + ld_alpha * (per_token_logps * in_tail).sum(dim=1)


def f_divergence_scores(logratios: torch.Tensor, settings: PreferenceLossSettings) -> torch.Tensor:
    """f'(pi/ref) of the chosen or rejected sequences (f-DPO): the log-ratio itself under the reverse KL."""
    kind = settings.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":  # f'(u) = 1 - 1/u
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":  # f'(u) = log(2u / (1 + u))
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence":  # f'(u) = (u^(alpha-1) - 1) / (alpha - 1); the log-ratio as alpha -> 1
        alpha = settings.f_alpha_divergence_coef
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        # exp in fp32 with the exponent capped where the input dtype would overflow after the cast back
        cap = 11.0 if logratios.dtype == torch.float16 else 80.0
        exponent = torch.clamp(((alpha - 1.0) * logratios).float(), max=cap)
        return (torch.exp(exponent) - 1.0).to(logratios.dtype) * (1.0 / (alpha - 1.0))
    raise ValueError(f"f_divergence_type {kind!r} is not one of {', '.join(F_DIVERGENCES)}.")


def pair_loss(loss_type: str, settings: PreferenceLossSettings, terms: PairTerms) -> torch.Tensor:
    """The per-pair loss [b] of one loss type (TRL's formula, each from its paper)."""
    beta, smoothing = settings.beta, settings.label_smoothing
    chosen, rejected = terms.chosen_logratios, terms.rejected_logratios
    chosen_score = f_divergence_scores(chosen, settings)
    rejected_score = f_divergence_scores(rejected, settings)
    margin = beta * (chosen_score - rejected_score)  # [b] the scaled reward margin most losses act on
    if loss_type == "sigmoid":
        return -F.logsigmoid(margin)
    if loss_type == "hinge":
        return torch.relu(1 - margin)
    if loss_type in ("ipo", "sigmoid_norm"):  # on the per-token average scores
        average = chosen_score / terms.chosen_tokens.clamp(min=1.0) - rejected_score / terms.rejected_tokens.clamp(
            min=1.0
        )
        return (average - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * average)
    if loss_type == "exo_pair":  # KL(softmax of the two rewards || [1 - eps, eps])
        ours, theirs = torch.sigmoid(margin), torch.sigmoid(-margin)
        return ours * (F.logsigmoid(margin) - math.log1p(-smoothing)) + theirs * (
            F.logsigmoid(-margin) - math.log(smoothing)
        )
    if loss_type == "robust":  # labels flipped with probability eps, debiased
        return (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) / (1 - 2 * smoothing)
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if loss_type == "sppo_hard":  # winner's log-ratio pulled to 1/(2 beta), loser's to -1/(2 beta)
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * (chosen - rejected))
    if loss_type == "discopop":  # logistic and exponential losses blended by sigmoid(margin / tau)
        blend = torch.sigmoid(margin / settings.discopop_tau)
        return -F.logsigmoid(margin) * (1 - blend) + torch.exp(-margin) * blend
    raise ValueError(f"loss_type {loss_type!r} is not a per-pair loss ({', '.join(PAIR_LOSSES)}).")


def wpo_weights(per_token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """WPO's pair weights [b]: the product of the two sequences' exp(mean over tokens of log p - log sum_v p_v^2),
    from [2b, t] tensors; constants for the gradient."""
    with torch.no_grad():
        aligned = (per_token_logps - log_sum_sq_probs) * mask  # [2b, t]
        weights = torch.exp(aligned.sum(dim=1) / mask.sum(dim=1).clamp_min(1))  # [2b]
        chosen, rejected = weights.chunk(2)
        return chosen * rejected


def chunk_loss(
    settings: PreferenceLossSettings,
    terms: PairTerms,
    num_pairs: int,
    pair_weights: torch.Tensor | None = None,
    chosen_logp_sum: torch.Tensor | None = None,
    chosen_token_count: torch.Tensor | None = None,
) -> torch.Tensor:
    """One chunk's share of the micro-batch's loss: sum over loss types of weight x (the chunk's per-pair losses
    summed, over `num_pairs`, the micro-batch's pair count; or for "sft" the chunk's chosen tokens' log-prob sum
    over `chosen_token_count`, the micro-batch's chosen-token count). `pair_weights` [b]: WPO's, or None."""
    loss = 0.0
    for loss_type, weight in zip(settings.loss_types, settings.loss_weights, strict=True):
        if loss_type == "sft":
            if pair_weights is not None:
                raise ValueError("'sft' with WPO weights needs the whole micro-batch's weights: run it in one piece.")
            part = -chosen_logp_sum / chosen_token_count
        else:
            losses = pair_loss(loss_type, settings, terms)  # [b]
            part = (losses if pair_weights is None else losses * pair_weights).sum() / num_pairs
        loss = loss + part * weight
    return loss
