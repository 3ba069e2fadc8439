"""slimrl's PPOConfig: transformers' TrainingArguments plus PPO's settings (TRL 0.x's names: num_ppo_epochs, kl_coef,
cliprange, vf_coef, cliprange_value, gamma, lam, response_length...), slimrl's chunked-step fields (SlimFields) and
rollout fields (RolloutFields), with errors that say what to change.

Batch arithmetic, as in every HF trainer: a micro-batch is `per_device_train_batch_size` sequences (split further
into `num_chunks` chunks for memory), an optimizer step is `gradient_accumulation_steps` micro-batches (one PPO
mini-batch), and a rollout is `num_mini_batches` mini-batches: `rollout_batch_size` prompts per process, one
completion each. Each rollout is trained on for `num_ppo_epochs` passes, so it spans `steps_per_rollout`
optimizer steps. (TRL 0.x's rollout was per_device_train_batch_size x gradient_accumulation_steps, which
num_mini_batches then divided; here a mini-batch is always exactly one optimizer step.)
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import TrainingArguments

from slimrl.trainers.common.slim_fields import SlimFields, bf16_supported, setting
from slimrl.trainers.ppo.losses import KL_ESTIMATORS
from slimrl.trainers.rollouts.rollout_fields import RolloutFields

PPO_BACKENDS = ("auto", "engine", "transformers")  # RolloutFields' backends without vLLM


@dataclass
class PPOConfig(RolloutFields, SlimFields, TrainingArguments):
    """Configuration of slimrl's PPOTrainer. Fields after TrainingArguments' own; every one has its help text."""

    # -- TrainingArguments defaults changed for PPO -------------------------------------------------------------
    logging_steps: float = setting(10, "Log every this many optimizer steps (TRL's default).")
    bf16: bool | None = setting(
        None,
        "bf16 mixed precision. None: on where the GPU supports bf16 (unless fp16), else off."
    )
    remove_unused_columns: bool = setting(
        False,
        "Keep the dataset's columns: reward functions receive them as keyword arguments."
    )

    # -- rollouts ---------------------------------------------------------------------------------------------
    response_length: int = setting(
        53,
        "Most tokens generated per completion (GRPO's max_completion_length). A completion ends earlier at an EOS "
        "token."
    )
    temperature: float = setting(
        0.7,
        "Sampling temperature of the rollouts. The policy's, old and reference log-probs are all taken at this "
        "temperature (logits / temperature), as in TRL 0.x."
    )
    top_p: float = setting(1.0, "Nucleus sampling of the rollouts (1.0: off).")
    top_k: int = setting(0, "Top-k sampling of the rollouts (0: off).")
    missing_eos_penalty: float | None = setting(
        None,
        "Subtracted from the score of a completion that reached response_length without an EOS token, so the "
        "policy learns to finish. None: no penalty."
    )
    reward_weights: list[float] | None = setting(
        None,
        "Weight of each reward function in the score (their weighted sum). None: all 1.0."
    )
    total_episodes: int | None = setting(
        None,
        "TRL 0.x's training length: completions to generate in all. When set it decides max_steps (whole "
        "rollouts, each spanning steps_per_rollout optimizer steps)."
    )

    # -- PPO ----------------------------------------------------------------------------------------------------
    num_ppo_epochs: int = setting(4, "Passes over each rollout, in a fresh random order.")
    num_mini_batches: int = setting(
        1,
        "Mini-batches (optimizer steps) per pass over a rollout; see `rollout_batch_size`."
    )
    kl_coef: float = setting(
        0.05,
        "Weight of the per-token KL penalty against the reference (the policy with its adapter disabled, or "
        "ref_model) in the reward. 0 turns it off."
    )
    kl_estimator: str = setting(
        "k1",
        "Per-token KL estimate in the penalty: 'k1' (log p - log q, unbiased) or 'k3' (lower variance, never "
        "negative); see http://joschu.net/blog/kl-approx.html."
    )
    cliprange: float = setting(0.2, "Policy ratio clip range: r in [1 - eps, 1 + eps].")
    vf_coef: float = setting(0.1, "Weight of the value loss in the loss.")
    cliprange_value: float = setting(
        0.2,
        "Value clip range: a value may move at most this far from its rollout-time value."
    )
    gamma: float = setting(1.0, "Discount factor of GAE.")
    lam: float = setting(0.95, "Lambda of GAE (1: Monte-Carlo returns, 0: one-step TD).")
    whiten_rewards: bool = setting(
        False,
        "Scale the per-token rewards of each rollout to unit variance (mean kept) before GAE."
    )
    target_kl: float | None = setting(
        None,
        "Early stop: when a mini-batch's approximate KL to the rollout's policy (policy/approxkl, measured in its "
        "forward) exceeds this, that step's update is dropped and the rollout's later steps are skipped (no "
        "forward, no update; they still count as steps). None: no early stop."
    )

    def __post_init__(self):
        self._check_ppo_fields()
        if self.bf16 is None:
            self.bf16 = not self.fp16 and bf16_supported(self.use_cpu)
        super().__post_init__()

    def _check_ppo_fields(self) -> None:
        if self.generation_backend not in PPO_BACKENDS:
            raise ValueError(f"generation_backend must be one of {', '.join(PPO_BACKENDS)} for PPO, got "
                             f"{self.generation_backend!r} (vLLM would need a weight sync after every optimizer step).")
        at_least_one = ("response_length", "num_ppo_epochs", "num_mini_batches")
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: PPO samples its rollouts, so it must be > 0 (e.g. 0.7).")
        for name in ("cliprange", "cliprange_value"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (0.2 is usual), got {getattr(self, name)}.")
        for name in ("kl_coef", "vf_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns its term off), got {getattr(self, name)}.")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}.")
        if self.target_kl is not None and not self.target_kl > 0:
            raise ValueError(f"target_kl must be > 0 (or None: no early stop), got {self.target_kl}.")
        if self.total_episodes is not None and self.total_episodes < 1:
            raise ValueError(f"total_episodes must be at least 1 (or None: max_steps decides), got "
                             f"{self.total_episodes}.")  # fmt: skip
        if str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no":
            raise ValueError("PPOTrainer has no evaluation loss: set eval_strategy='no' and measure held-out "
                             "performance with a callback (examples/ppo_arithmetic.py shows one way).")

    @property
    def rollout_batch_size(self) -> int:
        """Prompts per process in one rollout (one completion each): per_device_train_batch_size x
        gradient_accumulation_steps x num_mini_batches."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps trained on each rollout: num_ppo_epochs x num_mini_batches."""
        return self.num_ppo_epochs * self.num_mini_batches


def check_train_dataset(dataset, args: PPOConfig) -> None:
    """A train_dataset PPOTrainer can read: map-style, a 'prompt' column, at least one rollout's prompts."""
    if dataset is None or not hasattr(dataset, "__len__"):
        raise ValueError("PPOTrainer needs a map-style train_dataset (a datasets.Dataset) with a 'prompt' column.")
    columns = getattr(dataset, "column_names", None)
    if columns is not None and "prompt" not in columns:
        raise ValueError(f"train_dataset has columns {columns} but PPO needs a 'prompt' column (a string, or a list "
                         "of chat messages); rename the column holding the prompts.")  # fmt: skip
    needed = args.rollout_batch_size * args.world_size
    if len(dataset) < needed:
        raise ValueError(f"train_dataset has {len(dataset)} prompts, fewer than one rollout's {needed} "
                         "(per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x processes)."
                         " Add prompts or make the rollout smaller.")  # fmt: skip


__all__ = ["PPOConfig", "check_train_dataset"]
