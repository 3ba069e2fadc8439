"""BCO's loss, its running reward shift and its metrics, as pure functions over one chunk of sequences.

BCO (Jung et al. 2024, arXiv:2404.04656) trains the implicit reward r = beta * (log pi(y|x) - log pi_ref(y|x)) as the
logit of a binary classifier: thumbs-up completions towards r > delta, thumbs-down ones towards r < delta, where the
shift delta is the running mean of every reward seen in training so far (TRL 0.2x's RunningMoments: updated with the
micro-batch's rewards, gathered over processes, before the micro-batch's loss reads it). With N rows,

    loss = (1 / N) * sum_i  w_i * -log sigmoid(s_i * (r_i - delta)),   s_i = +1 desirable, -1 undesirable,

where w_i = 1 unless density-ratio matching (UDM, density_ratio.py) weights the undesirable rows; as in TRL 0.2x the
weights are not normalised (the mean is still over the N rows), and they are fixed per row before any chunking.

With N, delta and the weights fixed before the first chunk, the micro-batch's loss is the sum over its chunks of
their rows' terms over N: TRL's, up to summation order. delta carries no gradient (TRL's update runs under no_grad).

Shapes: b rows in the chunk, t shifted token positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


def bco_losses(rewards: torch.Tensor, desirable: torch.Tensor, delta: torch.Tensor,
               weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """[b] each row's loss: -log sigmoid(r - delta) for a desirable row, -log sigmoid(-(r - delta)) otherwise, times
    the row's density-ratio weight when UDM is on. rewards [b] (with grad), desirable [b] bool, delta a detached
    scalar, weights [b] detached (1 for desirable rows) or None."""
    shifted = rewards - delta
    losses = -F.logsigmoid(torch.where(desirable, shifted, -shifted))
    return losses if weights is None else losses * weights.to(losses.dtype)


@dataclass
class RunningMoments:
    """The running mean (and variance) of every reward seen so far, as TRL 0.2x's RunningMoments kept it: the count
    starts at a vanishing 1e-24, so the first update sets the mean to that batch's mean, and each later batch of n
    values moves it by (batch mean - mean) * n / (count + n), a mean over all values seen (not an EMA)."""

    mean: float = 0.0
    std: float = 1.0
    var: float = 1.0
    count: float = 1e-24

    @torch.no_grad()
    def update(self, values: torch.Tensor, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Fold in `values` [n] (this process's); `reduce_sum` sums a tensor over processes (None: one process), so
        every process folds in the same global batch and keeps the same mean."""
        values = values.detach().double().reshape(-1)
        total = torch.stack([values.sum(), values.new_tensor(values.numel())])
        total = reduce_sum(total) if reduce_sum is not None else total
        batch_count = total[1].item()
        if batch_count == 0:
            return
        batch_mean = total[0] / batch_count
        squares = ((values - batch_mean) ** 2).sum().reshape(1)
        squares = reduce_sum(squares) if reduce_sum is not None else squares
        batch_var, batch_mean = squares.item() / batch_count, batch_mean.item()
        # Chan et al.'s parallel update: merge (mean, var, count) with the batch's
        shift, new_count = batch_mean - self.mean, self.count + batch_count
        spread = self.var * self.count + batch_var * batch_count + shift**2 * self.count * batch_count / new_count
        self.mean += shift * batch_count / new_count
        self.var = spread / new_count
        self.std = math.sqrt(self.var * new_count / (new_count - 1)) if new_count > 1 else math.sqrt(self.var)
        self.count = new_count

    def state_dict(self) -> dict[str, float]:
        return asdict(self)


def append_metrics(metrics: dict[str, list], delta: float, sums: dict[str, float], total_train_tokens: int) -> None:
    """Append the micro-batch's metrics to `metrics` (the per-mode lists averaged at each log) with TRL's BCO names:
    delta, rewards/chosen|rejected|margins, logps/chosen|rejected, logits/chosen|rejected (plus TRL 1.16's entropy
    and num_tokens). `sums` holds STAT_NAMES and COUNT_NAMES summed over chunks and processes."""
    metrics["delta"].append(delta)
    tokens = sums["entropy_tokens"]
    metrics["entropy"].append(sums["entropy_sum"] / tokens if tokens > 0 else 0.0)
    metrics["num_tokens"] = [total_train_tokens]
    for side in ("chosen", "rejected"):
        if sums[f"{side}_tokens"] > 0:
            metrics[f"logits/{side}"].append(sums[f"{side}_logits_sum"] / sums[f"{side}_tokens"])
        if sums[f"num_{side}"] > 0:
            metrics[f"rewards/{side}"].append(sums[f"{side}_rewards_sum"] / sums[f"num_{side}"])
            metrics[f"logps/{side}"].append(sums[f"{side}_logps_sum"] / sums[f"num_{side}"])
    if sums["num_chosen"] > 0 and sums["num_rejected"] > 0:
        metrics["rewards/margins"].append(metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1])
