"""slimrl's DistillationConfig: TRL's stable DistillationConfig plus slimrl's settings."""

from __future__ import annotations

from dataclasses import dataclass

import trl

from slimrl.trainers.common.slim_fields import SlimFields
from slimrl.trainers.rollouts.rollout_fields import RolloutFields

__all__ = ["DistillationConfig"]


@dataclass
class DistillationConfig(RolloutFields, SlimFields, trl.DistillationConfig):
    """TRL's DistillationConfig plus slimrl's settings: the chunked step's (SlimFields: num_chunks, offloaded
    checkpoints, on_nonfinite) and the student's rollouts' (RolloutFields: generation_backend, deterministic_rollouts,
    generation_device), after TRL's fields."""
