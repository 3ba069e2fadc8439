"""Checkpoints that resume exactly: the trainer state that transformers and TRL leave out of a checkpoint.

Training N steps straight and training k steps, saving, and resuming with `train(resume_from_checkpoint=...)` should
log the same numbers and end with the same weights. transformers saves the weights, the optimizer and scheduler, the
trainer state and the python/numpy/torch RNG streams, and skips the batches already trained on. It leaves out:

- The data order of later epochs. A sampler that shuffles with its own `torch.Generator` (TRL's `RepeatSampler`,
  seeded once when built) draws each epoch's permutation from where that generator stands. A fresh trainer's stands
  at epoch 0, so a run resumed in epoch 1 or later replays epoch 0's order.
- TRL's generation buffer. GRPO and RLOO generate once every steps_per_generation x num_iterations micro-steps and
  keep the batch in `_buffered_inputs`, picked by the micro-step counter `_step`. Both start empty on resume, so a
  checkpoint inside a buffer's span regenerates (other completions, other random numbers) and shifts every later
  generation.
- What was accumulated since the last log (the Trainer's loss sum, TRL's `_metrics`), when logging_steps does not
  divide save_steps: the first log after resuming averages fewer steps.

`ResumableTrainerMixin` writes these next to the RNG state (`slimrl_trainer_state.pt`, one file per process like
`rng_state_{i}.pth`) and puts them back when the resumed run enters its first epoch, before that epoch's iterator
draws a permutation. A checkpoint saved without the file (by unpatched TRL) resumes as TRL would, with a warning.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from accelerate.utils import send_to_device

logger = logging.getLogger(__name__)

RESUME_STATE_NAME = "slimrl_trainer_state"
_FORMAT = 1
_MISSING = object()


def data_order_generators(dataloader) -> dict[str, torch.Generator]:
    """The torch.Generators that decide a dataloader's order, by attribute path ("batch_sampler.sampler.generator"):
    a sampler's own (TRL's RepeatSampler) and the loader's (worker seeds), through accelerate's wrappers."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def visit(obj, path: str, depth: int) -> None:
        if obj is None or depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        generator = getattr(obj, "generator", None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[f"{path}generator"] = generator
        for name in ("batch_sampler", "sampler", "base_dataloader"):
            visit(getattr(obj, name, None), f"{path}{name}.", depth + 1)

    visit(dataloader, "", 0)
    return found


def resume_state_path(checkpoint: str, world_size: int, process_index: int) -> str:
    suffix = f"_{process_index}" if world_size > 1 else ""
    return os.path.join(checkpoint, f"{RESUME_STATE_NAME}{suffix}.pt")


class ResumableTrainerMixin:
    """Goes first in the bases of a transformers Trainer subclass (TRL's trainers included); adds to each checkpoint
    what the next steps read besides the weights and RNG streams, and restores it on resume. Any trainer can use it:
    state a subclass does not have is skipped."""

    # Trainer attributes carried across checkpoints: TRL's generation buffer and its micro-step counter (GRPO, RLOO).
    resume_attributes: tuple[str, ...] = ("_step", "_buffered_inputs")

    # Written beside the RNG state: the same condition (not save_only_model) and one file per process, as the Trainer
    # writes rng_state_{i}.pth; the Trainer's checkpoint layout is unchanged.
    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)
        path = resume_state_path(output_dir, self.args.world_size, self.args.process_index)
        torch.save(self._resume_state(), path)

    # The Trainer runs each epoch here, iterator creation included: the one point, in every epoch, before the epoch's
    # permutation is drawn, and after the Trainer has reset its loss accumulators for this train() call.
    def _run_epoch(self, *args, **kwargs):
        call = inspect.signature(super()._run_epoch).bind(*args, **kwargs).arguments
        epoch, dataloader, checkpoint = call["epoch"], call["train_dataloader"], call["resume_from_checkpoint"]
        if checkpoint is not None and epoch == call["epochs_trained"]:
            self._restore_resume_state(checkpoint, epoch, dataloader)
        self._resume_epoch = epoch
        self._resume_dataloader = dataloader
        self._resume_epoch_start_order = _generator_states(dataloader)
        return super()._run_epoch(*args, **kwargs)

    # -- what is saved ---------------------------------------------------------------------------------------------

    def _resume_state(self) -> dict:
        dataloader = getattr(self, "_resume_dataloader", None)
        attributes = {}
        for name in self.resume_attributes:
            value = getattr(self, name, _MISSING)
            if value is not _MISSING:
                attributes[name] = value
        metrics = getattr(self, "_metrics", None)
        train_metrics = metrics.get("train", {}) if isinstance(metrics, dict) else {}
        loss_sum = getattr(self, "_tr_loss", None)
        return {
            "format": _FORMAT,
            # data order: where the generators stood when this epoch began (a resume inside this epoch redraws its
            # permutation) and where they stand now (a resume at the next epoch's start draws the next one)
            "epoch": getattr(self, "_resume_epoch", None),
            "order_at_epoch_start": getattr(self, "_resume_epoch_start_order", {}),
            "order_now": _generator_states(dataloader) if dataloader is not None else {},
            "attributes": attributes,
            # accumulated since the last log; logged at the next logging step
            "loss_since_log": loss_sum.detach().cpu() if isinstance(loss_sum, torch.Tensor) else None,
            "global_step_last_logged": getattr(self, "_globalstep_last_logged", None),
            "train_metrics_since_log": {name: list(values) for name, values in train_metrics.items()},
        }

    # -- what is restored ------------------------------------------------------------------------------------------

    def _restore_resume_state(self, checkpoint: str, epoch: int, dataloader) -> None:
        path = resume_state_path(checkpoint, self.args.world_size, self.args.process_index)
        if not os.path.isfile(path):
            logger.warning(
                "slimrl: %s has no %s (saved by another trainer?): resuming without the data order, generation "
                "buffer and unlogged metrics, so the run can differ from an uninterrupted one.",
                checkpoint,
                os.path.basename(path),
            )
            return
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # e.g. a buffer holding images, which weights_only loading refuses
            logger.warning(
                "slimrl: could not load %s (%s): resuming without it, so the run can differ from an uninterrupted one.",
                path,
                error,
            )
            return
        self._restore_data_order(state, epoch, dataloader)
        for name, value in state["attributes"].items():
            # TRL builds its buffer on the training device; the file holds it on the CPU
            setattr(self, name, send_to_device(value, self.accelerator.device))
        self._restore_unlogged(state)

    def _restore_data_order(self, state: dict, epoch: int, dataloader) -> None:
        if state["epoch"] == epoch:  # resumed inside the epoch the checkpoint was saved in
            saved = state["order_at_epoch_start"]
        elif state["epoch"] is not None and state["epoch"] + 1 == epoch:  # saved at that epoch's last step
            saved = state["order_now"]
        else:
            logger.warning(
                "slimrl: the checkpoint was saved in epoch %s but training resumes in epoch %d: data order not "
                "restored.",
                state["epoch"],
                epoch,
            )
            return
        generators = data_order_generators(dataloader)
        for path, generator_state in saved.items():
            if path in generators:
                generators[path].set_state(generator_state)
            else:
                logger.warning("slimrl: the checkpoint has a data-order generator at %s; the dataloader has not.", path)

    def _restore_unlogged(self, state: dict) -> None:
        loss_sum = getattr(self, "_tr_loss", None)
        if state["loss_since_log"] is not None and isinstance(loss_sum, torch.Tensor):
            loss_sum += state["loss_since_log"].to(loss_sum.device)  # in place: the epoch loop holds this tensor
        if state["global_step_last_logged"] is not None:
            self._globalstep_last_logged = state["global_step_last_logged"]
        metrics = getattr(self, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            for name, values in state["train_metrics_since_log"].items():
                metrics["train"][name].extend(values)


def _generator_states(dataloader) -> dict[str, torch.Tensor]:
    return {path: generator.get_state() for path, generator in data_order_generators(dataloader).items()}
