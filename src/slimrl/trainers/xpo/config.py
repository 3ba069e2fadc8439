"""XPOConfig: slimrl's online DPO config plus XPO's `alpha`, as TRL's last XPOConfig (trl.experimental.xpo in TRL
1.x, trl.trainer.xpo_config in 0.2x) named and defaulted it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slimrl.trainers.online_dpo.trainer import OnlineDPOConfig

__all__ = ["XPOConfig", "checked_alpha"]

TRL_DEFAULT_ALPHA = 1e-5


@dataclass
class XPOConfig(OnlineDPOConfig):
    """slimrl's OnlineDPOConfig (TRL's fields, the chunked step's and the rollouts') plus XPO's weight of the
    exploration term. A one-element list becomes its float, as in TRL."""

    alpha: list[float] = field(
        default_factory=lambda: [TRL_DEFAULT_ALPHA],
        metadata={"help": "Weight of the XPO loss term (alpha times the policy's log-probability of the reference "
                          "model's completion). If a list of floats is provided then the alpha is selected for each "
                          "new epoch and the last alpha is used for the rest of the epochs."},
    )  # fmt: skip

    def __post_init__(self):
        super().__post_init__()
        self.alpha = checked_alpha(self.alpha)


def checked_alpha(alpha) -> float | list[float]:
    """`alpha` as XPO reads it: a float, or a list of floats (one per epoch) of two or more; a one-element list
    becomes its float. Anything else is an error that says what to pass."""
    values = list(alpha) if isinstance(alpha, (list, tuple)) else [alpha]
    if not values:
        raise ValueError("XPOConfig.alpha is an empty list: pass a float (e.g. alpha=1e-5) or one float per epoch.")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"XPOConfig.alpha must be finite numbers, got {alpha!r}: pass a float (e.g. alpha=1e-5) "
                             "or a list of floats, one per epoch.")  # fmt: skip
    values = [float(value) for value in values]
    return values[0] if len(values) == 1 else values
