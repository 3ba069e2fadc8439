"""What the unpaired-feedback trainers (KTO, BCO) share: the metric sums a chunk of sequences contributes, in one
order, and the reference model's forward (a separate model, or the policy with its "ref" adapter or none)."""

from __future__ import annotations

import contextlib

import torch
from accelerate.utils import is_peft_model
from trl.trainer.utils import use_adapter

from slimrl.models.checkpointing import gradient_free_forward

# The sums a chunk contributes to the metrics, in this order (`chunk_stats`); the trainer appends the counts.
STAT_NAMES = (
    "entropy_sum",  # entropy over completion tokens
    "entropy_tokens",
    "chosen_logits_sum",  # mean-over-vocabulary logit, summed over desirable rows' completion tokens
    "chosen_tokens",
    "rejected_logits_sum",
    "rejected_tokens",
    "chosen_rewards_sum",  # beta * log-ratio, NaN-skipping sum over desirable rows
    "chosen_logps_sum",
    "rejected_rewards_sum",
    "rejected_logps_sum",
)
COUNT_NAMES = ("num_chosen", "num_rejected", "attention_tokens")


def chunk_stats(
    logps: torch.Tensor,  # [b] completion log-probs
    rewards: torch.Tensor,  # [b] beta * log-ratio
    desirable: torch.Tensor,  # [b] bool
    entropy: torch.Tensor,  # [b, t]
    mean_logits: torch.Tensor,  # [b, t]
    token_mask: torch.Tensor,  # [b, t] completion tokens (shifted)
) -> torch.Tensor:  # [len(STAT_NAMES)] fp32, detached
    """The chunk's share of every metric sum, in STAT_NAMES order."""
    logps, rewards = logps.detach().float(), rewards.detach().float()
    entropy, mean_logits = entropy.detach().float(), mean_logits.detach().float()
    mask = token_mask.bool()
    chosen_tokens = mask & desirable[:, None]
    rejected_tokens = mask & ~desirable[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=logps.device)
    return torch.stack([
        (entropy * token_mask).sum(),
        token_mask.sum().float(),
        torch.where(chosen_tokens, mean_logits, zero).sum(),
        chosen_tokens.sum().float(),
        torch.where(rejected_tokens, mean_logits, zero).sum(),
        rejected_tokens.sum().float(),
        torch.where(desirable, rewards, zero).nansum(),
        torch.where(desirable, logps, zero).nansum(),
        torch.where(desirable, zero, rewards).nansum(),
        torch.where(desirable, zero, logps).nansum(),
    ])  # fmt: skip


@contextlib.contextmanager
def reference_forward(trainer):
    """TRL's reference for `trainer`: its separate `ref_model`, else the policy with the "ref" adapter (or none)
    active; no grad, and no checkpointing recompute."""
    with torch.no_grad(), gradient_free_forward(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        if trainer.ref_model is None and is_peft_model(trainer.model):
            unwrapped = trainer.accelerator.unwrap_model(trainer.model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                yield trainer.model
        else:
            yield trainer.ref_model


def gathered_sums(trainer, mode: str, stats: torch.Tensor, desirable: torch.Tensor, attention_mask) -> dict:
    """The micro-batch's STAT_NAMES sums (`stats`, summed over its chunks) and COUNT_NAMES counts, summed over the
    processes in one call (a [1, K] tensor, so gather_for_metrics drops the same duplicated processes as it does for
    TRL's scalars); in training, the attended tokens are added to the trainer's `num_tokens` count."""
    counts = torch.stack([desirable.sum(), (~desirable).sum(), attention_mask.sum()])
    local = torch.cat([stats, counts.to(stats)])
    sums = dict(zip(STAT_NAMES + COUNT_NAMES, trainer.accelerator.gather_for_metrics(local[None]).sum(0).tolist(),
                    strict=True))  # fmt: skip
    if mode == "train":
        trainer._total_train_tokens += int(sums["attention_tokens"]) // trainer._tp_size
    return sums
