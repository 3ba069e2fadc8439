"""Where a GRPO optimizer step's wall time goes: generation, reward, training.

`StepTimer().attach(trainer)` wraps two methods on the trainer *instance* (its class is left alone), so the same
code times TRL's and slimrl's GRPOTrainer:
  generation  `_generate_single_turn`: the rollout (slimrl's engine, TRL's `generate`, or vLLM)
  reward      `_calculate_rewards`: the reward functions on the decoded completions
  training    the rest of the step (tokenising and decoding, advantages, the loss's forward and backward, the
              optimizer), i.e. step minus the other two, so the three parts add up to the step.
A step runs from the trainer's `on_step_begin` to its `on_step_end`. When the trainer computes on CUDA, the clock
synchronises the device at these boundaries only (not per kernel), so queued GPU work is counted in its phase.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from transformers import TrainerCallback

PHASE_METHODS = {"generation": "_generate_single_turn", "reward": "_calculate_rewards"}


def phase_methods(trainer) -> dict[str, str]:
    """The trainer's rollout and reward methods: its `timed_phases` (slimrl's PPO), else TRL's GRPO/RLOO names."""
    return getattr(trainer, "timed_phases", PHASE_METHODS)


class StepTimer(TrainerCallback):
    """Per optimizer step: `step_s`, `generation_s`, `reward_s`, `training_s` (and with `track_memory` on CUDA,
    `generation_peak_GiB`, `training_peak_GiB`, `peak_GiB`), plus `engine_stats` after a rollout by slimrl's engine
    and, once the trainer logs the step, its numeric `logs`. Records are in `steps`, in order.

    on_step: called with a step's record when its training logs arrive (every step with `logging_steps=1`).
    track_memory: reset CUDA's peak-memory counter at the step's start and as generation starts and ends, to split
        the peak between the rollout and the rest (this also resets what other code measures as the step's peak).
    """

    def __init__(self, on_step: Callable[[dict], None] | None = None, track_memory: bool = False):
        self.steps: list[dict] = []
        self.on_step = on_step
        self.track_memory = track_memory
        self.cuda = False
        self._trainer = None
        self._current: dict | None = None
        self._start = 0.0
        self._depth = dict.fromkeys(PHASE_METHODS, 0)

    def attach(self, trainer) -> StepTimer:
        """Time `trainer`'s steps: wrap its rollout and reward methods and register this callback. Returns self."""
        if self._trainer is not None:
            raise ValueError("This StepTimer is already attached to a trainer; make one timer per trainer.")
        self._trainer = trainer
        self.cuda = torch.device(trainer.args.device).type == "cuda"
        for phase, name in phase_methods(trainer).items():
            setattr(trainer, name, self._timed(getattr(trainer, name), phase))
        trainer.add_callback(self)
        return self

    def detach(self) -> None:
        """Give the trainer its own methods back and stop timing."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        for name in phase_methods(trainer).values():
            vars(trainer).pop(name, None)  # the instance attribute shadowed the class's method
        trainer.remove_callback(self)

    def step(self, global_step: int) -> dict | None:
        """The record of optimizer step `global_step` (1-based, as `TrainerState.global_step` after the step)."""
        return next((r for r in reversed(self.steps) if r["step"] == global_step), None)

    def clock(self) -> float:
        """Seconds on a monotonic clock, after the queued CUDA work when the trainer runs on CUDA."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _timed(self, method, phase: str):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            outermost = self._depth[phase] == 0 and self._current is not None
            self._depth[phase] += 1
            if outermost and phase == "generation" and self.track_memory and self.cuda:
                torch.cuda.reset_peak_memory_stats()  # the rollout's own peak
            start = self.clock() if outermost else 0.0
            try:
                return method(*args, **kwargs)
            finally:
                self._depth[phase] -= 1
                if outermost and self._current is not None:
                    self._current[f"{phase}_s"] += self.clock() - start
                    if phase == "generation":
                        self._after_generation(self._current)

        return timed

    def _after_generation(self, record: dict) -> None:
        if self.track_memory and self.cuda:
            record["generation_peak_GiB"] = max(record.get("generation_peak_GiB", 0.0), _peak_GiB())  # several rollouts
            torch.cuda.reset_peak_memory_stats()  # what follows is the reward and training phases' peak
        engine = getattr(self._trainer, "rollout_engine", None)  # slimrl's trainer, once its engine has run
        stats = getattr(engine, "last_stats", None)
        if stats:
            record["engine_stats"] = {k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.track_memory and self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self._current = {"step": state.global_step + 1, "generation_s": 0.0, "reward_s": 0.0}
        self._start = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        record, self._current = self._current, None
        if record is None:
            return
        record["step"] = state.global_step
        record["step_s"] = self.clock() - self._start
        record["training_s"] = record["step_s"] - record["generation_s"] - record["reward_s"]
        if self.track_memory and self.cuda:
            record["training_peak_GiB"] = _peak_GiB()
            record["peak_GiB"] = max(record["training_peak_GiB"], record.get("generation_peak_GiB", 0.0))
        self.steps.append(record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        record = self.step(state.global_step)
        if record is None or not logs or "loss" not in logs or "logs" in record:
            return  # not a training step's log (the run's summary has train_loss), or already merged
        record["logs"] = {k: v for k, v in logs.items() if isinstance(v, int | float | str)}
        if self.on_step is not None:
            self.on_step(record)


def _peak_GiB() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


__all__ = ["PHASE_METHODS", "StepTimer"]
