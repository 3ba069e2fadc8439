"""TRL's GRPO metrics, computed chunk by chunk and logged once per micro-batch with TRL's names, order and reductions.

A chunk reports detached tensors (`chunked_step.run_chunks` sums them over the chunks):
- a masked mean as its two parts, [sum, count], so the micro-batch's mean is sum / count over all chunks and
  processes, as TRL's mean over the whole micro-batch;
- a per-sequence mean, for TRL's min/max over sequences, as a vector over the micro-batch's rows (`Chunk.spread`);
- the policy loss and the entropy bonus's [entropy sum, token count], under the names below.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import nanmax, nanmin

from slimrl.trainers.common.chunked_step import Chunk, ChunkStats
from slimrl.trainers.grpo.loss import CLIPPED_LOSSES, ChunkLossTerms

POLICY_LOSS = "policy_loss"  # the chunk's weighted policy loss (before accumulation scaling), scalar
ENTROPY_STATS = "entropy_bonus/sum_and_count"  # [entropy sum, tokens] the entropy bonus averaged over; not logged
SEQUENCE_REDUCERS = {"clip_ratio/low_min": nanmin, "clip_ratio/high_max": nanmax}  # per-sequence metrics


def mean_parts(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [2] fp32: sum, count
    """The parts of TRL's masked mean of `x` ([b, t] per token, or [b, 1] per sequence: a plain mean)."""
    x = x.detach()
    if x.shape[1] == 1:  # one value per sequence (sequence-level importance sampling)
        return torch.stack([x.sum().float(), torch.tensor(float(x.shape[0]), device=x.device)])
    return torch.stack([(x * mask).sum().float(), mask.sum().float()])


def sequence_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # [b]
    x = x.detach()
    return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)


def chunk_metrics(
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    terms: ChunkLossTerms,
    entropies: torch.Tensor,  # [b, t]
    advantages: torch.Tensor,  # [b, 1] or [b, t]
    mask: torch.Tensor,  # [b, t]
    chunk: Chunk,
    num_rows: int,
) -> ChunkStats:
    """The parts of the metrics TRL's `_compute_loss` logs for this chunk, in TRL's order."""
    stats = {}
    if terms.per_token_kl is not None:
        stats["kl"] = mean_parts(terms.per_token_kl, mask)
    stats["entropy"] = mean_parts(entropies, mask)
    coef_1 = terms.coef_1.detach()
    if loss_type in CLIPPED_LOSSES:
        low = ((coef_1 < 1 - epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + epsilon_high) & (advantages > 0)).float()
        stats["clip_ratio/low_mean"] = mean_parts(low, mask)
        stats["clip_ratio/high_mean"] = mean_parts(high, mask)
        stats["clip_ratio/region_mean"] = mean_parts(((low + high) > 0).float(), mask)
        stats["clip_ratio/low_min"] = chunk.spread(sequence_means(low, mask), num_rows)
        stats["clip_ratio/high_max"] = chunk.spread(sequence_means(high, mask), num_rows)
    elif loss_type == "cispo":
        stats["cispo_clip_ratio"] = mean_parts(((coef_1 > epsilon_high) & (advantages > 0)).float(), mask)
    elif loss_type == "vespo":
        stats["vespo/phi_seq_mean"] = mean_parts(terms.phi_seq, mask)
    return stats


def append_metrics(metrics: dict[str, list], totals: ChunkStats, accelerator) -> None:
    """Append the micro-batch's masked means (reduced over processes) and per-sequence extremes (gathered) to
    `metrics`, TRL's per-mode metric lists. The policy loss and entropy-bonus parts are the trainer's to log."""
    for name, parts in totals.items():
        if name in (POLICY_LOSS, ENTROPY_STATS) or name in SEQUENCE_REDUCERS:
            continue
        total = accelerator.reduce(parts, reduction="sum")
        metrics[name].append((total[0] / total[1].clamp(min=1.0)).item())
    for name, reduce in SEQUENCE_REDUCERS.items():
        if name in totals:
            metrics[name].append(reduce(accelerator.gather(totals[name])).item())
