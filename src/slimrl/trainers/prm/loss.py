"""The process reward model's loss: token-level cross-entropy over the labelled positions (each step's separator
token), averaged over the micro-batch's labelled tokens, the mean transformers' token-classification models compute
(and TRL's PRMTrainer logged). Chunked, each chunk's summed cross-entropy is divided by the micro-batch's count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimrl.trainers.prm.inputs import IGNORE_INDEX


def labelled_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many positions of `labels` [N, T] carry a label: the loss's normaliser (a 0-dim tensor, no host sync)."""
    return (labels != IGNORE_INDEX).sum()


def step_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (fp32) of the labelled positions: logits [b, t, C], labels [b, t] (-100: none)."""
    labelled = labels != IGNORE_INDEX  # [b, t]
    picked = logits[labelled].float()  # [n, C]: only the labelled positions reach the softmax
    return F.cross_entropy(picked, labels[labelled], reduction="sum")


def micro_batch_loss(nll_sum: torch.Tensor, normaliser: torch.Tensor | float) -> torch.Tensor:
    """A chunk's share of the micro-batch's mean. A micro-batch with no label left (truncation cut every step)
    divides by 1: loss 0 and no gradient, where the mean would be 0/0 = NaN and stop training."""
    if isinstance(normaliser, torch.Tensor):
        return nll_sum / normaliser.clamp(min=1)
    return nll_sum / max(normaliser, 1)
