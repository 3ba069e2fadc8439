"""GRPO-family loss math as pure functions over one chunk of sequences.

TRL computes the loss of a whole micro-batch at once. To run the micro-batch in chunks and still get the same
gradient, every loss type is written as a sum over sequences of

    sequence_weight[i] * sum_t per_token_loss[i, t] * mask[i, t]

where `sequence_weight` depends only on micro-batch-wide quantities (token counts, batch size, accumulation steps),
computed once before the first chunk. The sum over chunks is then TRL's loss, up to summation order.
Shapes: B sequences in the chunk, T completion tokens; "per-token" tensors are [B, T], sequence-level ones [B, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_SUM_LOSSES = ("cispo", "dapo", "vespo")  # normalised by the token count of the whole generation batch
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


@dataclass(frozen=True)
class PolicyLossSettings:
    """The trainer's loss settings, read once from TRL's attributes."""

    loss_type: str
    importance_sampling_level: str  # "token" | "sequence"
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    use_bias_correction_kl: bool
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo_k_pos: float
    vespo_lambda_pos: float
    vespo_k_neg: float
    vespo_lambda_neg: float
    off_policy_mask_threshold: float | None
    apply_vllm_is_ratio: bool

    @classmethod
    def from_trainer(cls, trainer) -> PolicyLossSettings:
        """The settings of a TRL GRPOTrainer (its attributes where TRL resolved them, else its args)."""
        args = trainer.args
        return cls(
            loss_type=trainer.loss_type,
            importance_sampling_level=trainer.importance_sampling_level,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            delta=args.delta,
            beta=trainer.beta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            apply_vllm_is_ratio=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
        )


@dataclass
class ChunkLossTerms:
    """What one chunk's policy loss produces: the per-token loss and the tensors its metrics are made of."""

    per_token_loss: torch.Tensor  # [B, T] or [B, 1]
    coef_1: torch.Tensor  # importance ratio (after the delta clamp), [B, T] or [B, 1]
    per_token_kl: torch.Tensor | None  # [B, T], only when beta != 0
    phi_seq: torch.Tensor | None  # [B, 1], vespo only


def sequence_weights(
    loss_type: str,
    mask: torch.Tensor,  # [N, T] completion mask of the whole micro-batch
    *,
    max_completion_length: int,
    token_normalizer: torch.Tensor | None,
) -> torch.Tensor:  # [N] fp32
    """Per-sequence weights that turn masked per-token loss sums into TRL's policy loss (before accumulation scaling).

    `token_normalizer` is the token count TRL divides the cispo/dapo/vespo loss by (num_items_in_batch rescaled to one
    accumulation window); it already contains the accumulation factor, so those losses are not divided again.
    """
    num_sequences = mask.size(0)
    lengths = mask.sum(-1).float()  # [N]
    if loss_type in ("grpo", "sapo"):
        return 1.0 / (num_sequences * lengths.clamp(min=1.0))
    if loss_type == "bnpo":
        return torch.full_like(lengths, 1.0) / mask.sum().float().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return torch.full_like(lengths, 1.0 / (num_sequences * max_completion_length))
    if loss_type in TOKEN_SUM_LOSSES:
        return torch.full_like(lengths, 1.0) / token_normalizer.float()
    if loss_type == "luspo":
        return torch.full_like(lengths, 1.0 / num_sequences)
    raise ValueError(f"Unknown loss type {loss_type!r}; slimrl supports {', '.join(LOSS_TYPES)}.")


def gamma_weights(
    settings: PolicyLossSettings,
    advantages: torch.Tensor,  # [B, 1]
    log_ratio: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    is_ratio: torch.Tensor | None,  # [B, T] or None
) -> torch.Tensor:  # [B, 1], no grad
    """VESPO's gamma weighting phi(w) = exp(lambda + k log w - lambda w) of the sequence ratio w, in log space."""
    with torch.no_grad():
        log_floor = -18.420680743952367  # log(1e-8): the clamp VESPO applies to log w
        seq_log_ratio = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if is_ratio is not None:
            seq_log_ratio = seq_log_ratio + torch.log(is_ratio).clamp(log_floor, 20.0).sum(-1, keepdim=True)
        log_w = seq_log_ratio.clamp(log_floor, 20.0)
        positive = advantages >= 0
        k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg)
        lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(
    advantages: torch.Tensor,  # [B, 1]
    logps: torch.Tensor,  # [B, T]
    sampling_logps: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    threshold: float,
) -> torch.Tensor:  # [B, 1]
    """Keep a sequence when its advantage is non-negative or its mean KL to the sampler is at most `threshold`."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # unscorable tokens give no evidence
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def importance_log_weights(
    level: str,
    log_ratio: torch.Tensor,  # [B, T] log pi / pi_old per token
    mask: torch.Tensor,  # [B, T]
) -> torch.Tensor:  # [B, T] ("token") or [B, 1] ("sequence")
    """log of the importance ratio: per token, or the masked mean over each sequence (GSPO's sequence level)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"Unknown importance_sampling_level {level!r}; use 'token' or 'sequence'.")


def surrogate_loss(
    settings: PolicyLossSettings,
    coef_1: torch.Tensor,  # [B, T] or [B, 1] importance ratio
    logps: torch.Tensor,  # [B, T]
    log_ratio: torch.Tensor,  # [B, T]
    advantages: torch.Tensor,  # [B, 1] or [B, T]
    mask: torch.Tensor,  # [B, T]
    is_ratio: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token loss of the loss type before masks and KL, the ratio TRL's clipping metrics read, VESPO's phi)."""
    loss_type = settings.loss_type
    if loss_type == "cispo":
        return -torch.clamp(coef_1, max=settings.epsilon_high).detach() * advantages * logps, coef_1, None
    if loss_type in CLIPPED_LOSSES:
        coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
        kept_coef = coef_1 if settings.delta is None else torch.clamp(coef_1, max=settings.delta)  # two-sided clip
        return -torch.min(kept_coef * advantages, coef_2 * advantages), kept_coef, None
    if loss_type == "sapo":
        temperature = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        return -torch.sigmoid(temperature * (coef_1 - 1)) * 4 / temperature * advantages, coef_1, None
    if loss_type == "vespo":
        phi_seq = gamma_weights(settings, advantages, log_ratio, mask, is_ratio)
        return -phi_seq * advantages * logps, coef_1, phi_seq
    raise ValueError(f"Unknown loss type {loss_type!r}; slimrl supports {', '.join(LOSS_TYPES)}.")


def policy_loss_terms(
    settings: PolicyLossSettings,
    logps: torch.Tensor,  # [B, T] log-probs under the current policy (with grad)
    old_logps: torch.Tensor,  # [B, T] log-probs at sampling time (the policy before this update)
    advantages: torch.Tensor,  # [B, 1] or [B, T]
    mask: torch.Tensor,  # [B, T] completion (and tool) mask
    *,
    ref_logps: torch.Tensor | None = None,  # [B, T], when beta != 0
    is_ratio: torch.Tensor | None = None,  # vLLM importance-sampling ratio, [B, T] or [B, 1]
    sampling_logps: torch.Tensor | None = None,  # for the off-policy mask; defaults to old_logps
    entropy_mask: torch.Tensor | None = None,  # [B, T] bool, top-entropy tokens
) -> ChunkLossTerms:
    """Per-token loss of every GRPO variant TRL 1.16 implements, with the same formulas and clamps."""
    log_ratio = logps - old_logps  # [B, T]
    coef_1 = torch.exp(importance_log_weights(settings.importance_sampling_level, log_ratio, mask))

    per_token_kl = None
    if settings.beta != 0.0:
        ref_minus_policy = ref_logps - logps
        per_token_kl = torch.exp(ref_minus_policy) - ref_minus_policy - 1  # k3 estimator, [B, T]
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    per_token_loss, kept_coef, phi_seq = surrogate_loss(settings, coef_1, logps, log_ratio, advantages, mask, is_ratio)
    if settings.off_policy_mask_threshold is not None:
        reference = old_logps if sampling_logps is None else sampling_logps
        per_token_loss = per_token_loss * off_policy_mask(
            advantages, logps, reference, mask, settings.off_policy_mask_threshold
        )
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if settings.apply_vllm_is_ratio and settings.loss_type != "vespo":
        per_token_loss = per_token_loss * is_ratio
    if per_token_kl is not None:
        per_token_loss = per_token_loss + settings.beta * per_token_kl
    return ChunkLossTerms(per_token_loss=per_token_loss, coef_1=kept_coef, per_token_kl=per_token_kl, phi_seq=phi_seq)


def weighted_loss_sum(
    per_token_loss: torch.Tensor,  # [B, T] or [B, 1]
    mask: torch.Tensor,  # [B, T]
    weights: torch.Tensor,  # [B]
) -> torch.Tensor:  # scalar
    """sum_i weights[i] * sum_t per_token_loss[i, t] * mask[i, t]; [B, 1] losses broadcast over the mask as in TRL."""
    return ((per_token_loss * mask).sum(-1) * weights.to(per_token_loss.dtype)).sum()
