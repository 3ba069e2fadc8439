"""What every slimrl trainer does around TRL's step, whatever its algorithm: the layer each forward passes through.

`SlimTrainerMixin` goes first in a slimrl trainer's bases (`class GRPOTrainer(SlimTrainerMixin, trl.GRPOTrainer)`)
and overrides two HF Trainer methods, each keeping the Trainer's contract:
- `training_step`: runs TRL's step (forward, chunked backward, the scoring passes before it) inside
  `training_attention()` (masked SDPA calls off cuDNN: its backward returns NaN at some padded shapes, see
  `slimrl.ops.attention_backends`), then, at the step's last micro-batch, checks that the losses and the gradient are
  finite before the Trainer lets the optimizer write the weights (`finite.py`). Returns the loss tensor, as TRL's.
- `save_model`: refuses to write non-finite trainable weights (a checkpoint calls it before writing anything else).
"""

from __future__ import annotations

import logging

from accelerate.utils import DistributedType

from slimrl.ops.attention_backends import training_attention
from slimrl.ops.finite import NonFiniteError, StepFiniteness, drop_gradients, refuse_nonfinite_weights

logger = logging.getLogger(__name__)

SKIPPED_METRIC = "nonfinite_skipped"  # 1 for an optimizer step dropped by on_nonfinite="skip", else 0


class SlimTrainerMixin:
    """Reliability shared by slimrl's trainers; the algorithm's own overrides live in its subclass."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        tags = list(getattr(cls, "_tag_names", None) or [])  # the TRL trainer's model-card tags, inherited
        if "slimrl" not in tags:
            cls._tag_names = [*tags, "slimrl"]

    def training_step(self, model, inputs, num_items_in_batch=None):
        with training_attention():
            loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_finiteness().add_loss(loss)
        if self.accelerator.sync_gradients:  # the last micro-batch: the optimizer steps right after this returns
            self._check_step_is_finite(model)
        return loss

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        refuse_nonfinite_weights(self.model, f"the model to {output_dir or self.args.output_dir}", trainable_only=True)
        return super().save_model(output_dir, _internal_call)

    # -- helpers ---------------------------------------------------------------------------------------------------

    def _step_finiteness(self) -> StepFiniteness:
        if getattr(self, "_slimrl_finiteness", None) is None:
            self._slimrl_finiteness = StepFiniteness()
        return self._slimrl_finiteness

    def _check_step_is_finite(self, model) -> None:
        parameters = getattr(self, "_slimrl_trainable", None)
        if parameters is None:
            parameters = self._slimrl_trainable = [p for p in model.parameters() if p.requires_grad]
        reduce = None
        if self.accelerator.num_processes > 1:
            reduce = lambda flags: self.accelerator.reduce(flags, reduction="mean")  # noqa: E731
        finite, what = self._step_finiteness().verdict(parameters, reduce)
        policy = getattr(self.args, "on_nonfinite", "raise")
        if finite:
            if policy == "skip":
                self._record_train_metric(SKIPPED_METRIC, 0.0)
            return
        step = self.state.global_step + 1
        after_step = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if policy == "skip" and not after_step:
            drop_gradients(parameters)
            self._record_train_metric(SKIPPED_METRIC, 1.0)
            logger.warning("slimrl: optimizer step %d skipped (on_nonfinite='skip'): %s not finite.", step, what)
            return
        where = (
            "DeepSpeed had already applied the step inside its backward; the weights may be damaged, so resume from "
            "the last checkpoint"
            if after_step
            else "raised before the optimizer step: the weights, the optimizer state and the last checkpoint are as "
            "they were"
        )
        raise NonFiniteError(
            f"Optimizer step {step}: {what} not finite ({where}). Common causes: a learning rate too high, fp16 "
            "overflow (use bf16), a reward or advantage that is NaN, or a numeric bug in a kernel. Set "
            "on_nonfinite='skip' to drop such steps and go on."
        )

    def _record_train_metric(self, name: str, value: float) -> None:
        # TRL's trainers keep their per-step metrics in `_metrics[mode]`; the experimental ORPO / CPO ones in
        # `_stored_metrics[mode]`; online DPO in `stats[name]` (all averaged at the next log)
        for attribute in ("_metrics", "_stored_metrics"):
            metrics = getattr(self, attribute, None)
            if isinstance(metrics, dict) and ("train" in metrics or hasattr(metrics, "default_factory")):
                metrics["train"][name].append(value)
                return
        stats = getattr(self, "stats", None)
        if isinstance(stats, dict) and all(isinstance(v, list) for v in stats.values()):
            stats.setdefault(name, []).append(value)
            return
