"""PPO's math as plain functions of tensors: the per-token reward with its KL penalty, GAE, masked whitening, the
clipped policy and value losses, the approximate KL and the entropy.

Shapes: N sequences, T completion tokens. `mask` [N, T] is 1 on a completion's real tokens (up to and including the
EOS that ended it) and 0 on the right padding after them; every function here ignores what a masked position holds.
The trainer (trainers/ppo/trainer.py) sums the per-token terms over a mini-batch's real tokens and divides by their
count (`token_sum / minibatch_tokens`), so the sum over chunks and micro-batches is the mini-batch's token mean.

Where TRL 0.x's PPO trainer differs on purpose: it put the score one position after the last real token and let the
value of that position into the value loss (its `padding_mask_p1`); here the score is added at the last real token,
whose next value is 0 (the episode ends there), and only real tokens carry values and losses. Its approximate KL
averaged over padding too; here it is a masked mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k3")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is 1; what masked positions hold (even NaN or inf) never enters."""
    return torch.where(mask.bool(), values, torch.zeros_like(values)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the positions where `mask` is 1 (NaN when there are none)."""
    return masked_sum(values, mask) / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked-in positions; `unbiased` applies Bessel's correction n / (n - 1), which needs n > 1."""
    count = mask.sum()
    if unbiased and count < 2:
        raise ValueError(f"an unbiased variance needs at least 2 unmasked values, got {int(count)}; the rollout has "
                         "too few completion tokens to whiten (use more sequences per rollout).")  # fmt: skip
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    return variance * count / (count - 1) if unbiased else variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8):
    """(values - mean) / sqrt(var + eps) with the mean and unbiased variance of the masked-in positions only; with
    `shift_mean=False` the mean is added back (only the scale changes). Masked positions come back as 0."""
    mean, variance = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def kl_per_token(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs [N, T].

    k1: log p - log q (unbiased, can be negative). k3: (q/p - 1) - log(q/p) (unbiased, never negative, lower
    variance); both from http://joschu.net/blog/kl-approx.html, as TRL 0.x's `kl_estimator`.
    """
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k3":
        log_ratio = ref_logps - logps
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}.")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index [N] of each row's last real token (0 for a row without any)."""
    positions = torch.arange(1, mask.size(1) + 1, device=mask.device)
    return ((mask.bool() * positions).amax(dim=1) - 1).clamp(min=0)


@dataclass(frozen=True)
class TokenRewards:
    rewards: torch.Tensor  # [N, T] -kl_coef * kl on every real token, plus the score at the last real token
    kl: torch.Tensor  # [N, T] per-token KL estimate, 0 on padding
    non_score_reward: torch.Tensor  # [N, T] -kl_coef * kl, 0 on padding


def token_rewards(scores, logps, ref_logps, mask, kl_coef: float, estimator: str = "k1") -> TokenRewards:
    """The reward of each completion token: a KL penalty on every real token, and the sequence's score [N] added at
    its last real token (the token that ended it). Padding gets 0."""
    real = mask.bool()
    kl = torch.where(real, kl_per_token(logps, ref_logps, estimator), torch.zeros_like(logps))
    non_score = -kl_coef * kl
    last = last_token_index(mask)  # [N]
    score_at_end = torch.zeros_like(non_score).scatter(1, last[:, None], scores.to(non_score.dtype)[:, None])
    rewards = non_score + torch.where(real, score_at_end, torch.zeros_like(score_at_end))
    return TokenRewards(rewards=rewards, kl=kl, non_score_reward=non_score)


def gae(rewards, values, mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each completion, from its end back to its start.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, with V and r taken as 0 on padding
    (so the value after a completion's last real token is 0: the episode ends there). Returns (advantages, returns =
    advantages + values), both [N, T] and 0 on padding.
    """
    real = mask.bool()
    values = torch.where(real, values, torch.zeros_like(values))
    rewards = torch.where(real, rewards, torch.zeros_like(rewards))
    width = rewards.size(1)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # A_{t+1}, per row
    for t in reversed(range(width)):
        next_value = values[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(real[:, t], delta + gamma * lam * running, torch.zeros_like(running))
        advantages[:, t] = running
    return advantages, advantages + values


@dataclass(frozen=True)
class PolicyTerms:
    loss: torch.Tensor  # [N, T] per-token clipped surrogate loss (with grad)
    clipped: torch.Tensor  # [N, T] bool, the clipped side was the larger loss (its gradient is 0)


def clipped_policy_loss(ratio: torch.Tensor, advantages: torch.Tensor, cliprange: float) -> PolicyTerms:
    """PPO's pessimistic surrogate per token: max(-A * r, -A * clip(r, 1 - eps, 1 + eps)).

    At exactly r = 1 +- eps both sides are equal: the token is not counted as clipped, and its gradient is the
    unclipped one (-A); past the boundary on the side the advantage pushes towards, the gradient is 0.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return PolicyTerms(loss=torch.max(unclipped, clipped), clipped=(clipped > unclipped).detach())


def clipped_value_loss(values, old_values, returns, cliprange_value: float) -> PolicyTerms:
    """0.5 * max((V - R)^2, (V_clip - R)^2) per token, V_clip = old V + clip(V - old V, -eps_v, eps_v): the value
    may not gain from moving further than eps_v from where it was at rollout time."""
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    return PolicyTerms(loss=0.5 * torch.max(unclipped_loss, clipped_loss),
                       clipped=(clipped_loss > unclipped_loss).detach())  # fmt: skip


def probability_ratio(logps: torch.Tensor, old_logps: torch.Tensor) -> torch.Tensor:
    """pi(a|s) / pi_old(a|s) per token, from log-probs."""
    return torch.exp(logps - old_logps)


def approx_kl(logps: torch.Tensor, old_logps: torch.Tensor) -> torch.Tensor:
    """Per-token 0.5 * (log pi - log pi_old)^2, TRL 0.x's `approxkl` (before its mean): the second-order estimate of
    KL(pi_old || pi) that early stopping (`target_kl`) watches."""
    return 0.5 * (logps - old_logps) ** 2


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension: logsumexp(x) - sum(softmax(x) * x)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def selected_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] per position, without materialising the whole log-softmax: [b, t, V] -> [b, t]."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


__all__ = [
    "KL_ESTIMATORS",
    "PolicyTerms",
    "TokenRewards",
    "approx_kl",
    "clipped_policy_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "gae",
    "kl_per_token",
    "last_token_index",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "probability_ratio",
    "selected_logprobs",
    "token_rewards",
]
