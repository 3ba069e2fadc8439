"""slimrl's GRPOConfig: TRL's, plus the settings of slimrl's step and engine, with errors for settings TRL accepts but
that cannot work. A plain `trl.GRPOConfig` (or none) given to slimrl's trainer gets these fields' defaults
(`with_slimrl_fields`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import trl

from slimrl.trainers.common.slim_fields import SlimFields
from slimrl.trainers.grpo.loss import LOSS_TYPES
from slimrl.trainers.rollouts.rollout_fields import RolloutFields, with_rollout_fields


@dataclass
class GRPOConfig(RolloutFields, SlimFields, trl.GRPOConfig):
    """TRL's GRPOConfig plus slimrl's settings (the shared ones in SlimFields; generation_backend and
    deterministic_rollouts in RolloutFields, shared with RLOO; shared_prompt_forward, GRPO's own), with errors for
    settings TRL accepts but that cannot work."""

    shared_prompt_forward: bool = field(
        default=False,
        metadata={
            "help": "Compute the G completions of each prompt against ONE copy of the prompt's activations in the "
            "training forward: each chunk holds whole prompt groups (rows with identical prompt ids), each packed "
            "as the prompt followed by its completions, attended so that a completion sees the prompt and itself "
            "only. Same log-probs, entropies and gradients as the plain forward; pays with long prompts and many "
            "generations. Falls back to the plain forward, with one log line naming why, where it cannot run "
            "(multimodal inputs, attention other than SDPA, sliding windows, no prompt shared in the micro-batch)."
        },
    )

    def __post_init__(self):
        self._check_grpo_fields()
        self._check_generation_settings()
        try:
            super().__post_init__()
        except ValueError as error:
            if "must be divisible by num_generations" in str(error):
                raise ValueError(self._divisibility_message()) from error
            raise

    def _check_grpo_fields(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss_type {self.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}.")

    def _check_generation_settings(self) -> None:
        if self.num_generations is not None and self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO compares each completion with the others of its prompt, "
                "so it needs at least 2 generations per prompt. Set num_generations to 2 or more (8 is common)."
            )
        if self.temperature <= 0:
            raise ValueError(
                f"temperature={self.temperature}: GRPO samples completions and scores them at this temperature, so "
                "it must be > 0 (greedy decoding would make every completion of a prompt identical). Use e.g. 1.0."
            )
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be positive; LoRA usually uses 5e-6 to 5e-4.")
        if self.learning_rate >= 1e-2:
            warnings.warn(
                f"learning_rate={self.learning_rate} is far above what LoRA fine-tuning tolerates (typically 5e-6 to "
                "5e-4) and will likely diverge; lower it unless you know why you need it.",
                UserWarning,
                stacklevel=3,
            )

    def _divisibility_message(self) -> str:
        groups = self.num_generations
        per_step = self.generation_batch_size
        return (
            f"The generation batch holds {per_step} completions (per_device_train_batch_size="
            f"{self.per_device_train_batch_size} x processes={self.world_size} x steps_per_generation="
            f"{self.steps_per_generation}), "
            f"which is not a multiple of num_generations={groups}, so some prompt would get a partial group. "
            f"Make per_device_train_batch_size x steps_per_generation a multiple of {groups} (e.g. "
            f"per_device_train_batch_size={groups}), or set generation_batch_size to a multiple of {groups}."
        )


def with_slimrl_fields(args, model) -> GRPOConfig:
    """The config slimrl's trainer runs with: None becomes slimrl's GRPOConfig named as TRL names its default
    (`<model name>-GRPO`); a plain trl.GRPOConfig keeps its values and gains slimrl's fields at their defaults."""
    return with_rollout_fields(args, model, GRPOConfig, "GRPO")
