"""One micro-batch through a trainer (loss, every trainable gradient, the metrics the call logged) and the
comparison every parity test makes between TRL's trainer and slimrl's on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tolerances import assert_close


def begin_step(trainer, accumulation: int, train: bool, store: str = "_metrics") -> str:
    """What HF Trainer sets before a micro-batch (model mode, accumulation count), gradients cleared, the metrics
    store of the mode emptied and the token counter reset so the call's metrics are its own. Returns the mode."""
    trainer.model.train(train)
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = accumulation
    mode = "train" if train else "eval"
    getattr(trainer, store)[mode].clear()
    if hasattr(trainer, "_total_train_tokens"):
        trainer._total_train_tokens = 0  # the num_tokens metric counts from here
    return mode


def cloned(batch: dict) -> dict:
    """The batch with its tensors copied: a trainer may write into its inputs."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def trainable_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def latest_metrics(trainer, mode: str, store: str = "_metrics") -> dict[str, float]:
    return {name: values[-1] for name, values in getattr(trainer, store)[mode].items()}


def loss_grads_metrics(trainer, batch: dict, accumulation: int = 1, train: bool = True, divide: bool = True):
    """One compute_loss, and in train mode the backward HF Trainer runs after it (of the loss over the accumulation
    steps when `divide`; GRPO's loss is already divided): the loss, each trainable gradient, the metrics logged."""
    mode = begin_step(trainer, accumulation, train)
    inputs = cloned(batch)
    if train:
        loss = trainer.compute_loss(trainer.model, inputs)
        (loss / accumulation if divide else loss).backward()
    else:
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, inputs)
    return loss.detach(), trainable_grads(trainer.model), latest_metrics(trainer, mode)


def assert_same_step(expected, actual, label: str, train: bool | None = True, nonzero_reference: bool = False,
                     skip_metrics: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Loss, every gradient and every metric (same names in the same order) agree at the fp32 tolerances.

    train: whether the reference must have gradients (None: not checked). nonzero_reference: a zero reference
    gradient is an error (it would pin nothing). Each gradient is compared relative to its tensor's largest entry:
    an elementwise rtol on near-zero entries would only measure summation order."""
    (loss_e, grads_e, metrics_e), (loss_a, grads_a, metrics_a) = expected, actual
    if train is not None:
        assert bool(grads_e) == train, f"{label}: the reference {'lacks' if train else 'has'} gradients"
    assert_same_loss_and_grads((loss_e, grads_e), (loss_a, grads_a), label, nonzero_reference)
    assert list(metrics_a) == list(metrics_e), f"{label}: metric names {list(metrics_a)} != {list(metrics_e)}"
    for name, value in metrics_e.items():
        if name not in skip_metrics:
            assert_close(torch.tensor(metrics_a[name]), torch.tensor(value), name=f"{label}: metric {name}")


def assert_same_loss_and_grads(expected, actual, label: str, nonzero_reference: bool = False) -> None:
    """(loss, {name: gradient}) pairs agree at the fp32 tolerances, each gradient relative to its tensor's largest
    entry (see `assert_same_step`); nonzero_reference: a zero reference gradient is an error."""
    (loss_e, grads_e), (loss_a, grads_a) = expected, actual
    assert_close(loss_a, loss_e, name=f"{label}: loss")
    assert grads_a.keys() == grads_e.keys(), f"{label}: different parameters received gradients"
    for name, grad in grads_e.items():
        scale = grad.abs().max().item()
        assert scale > 0 or not nonzero_reference, f"{label}: the reference gradient of {name} is zero"
        assert_close(grads_a[name] / scale, grad / scale, "grad_fp32", name=f"{label}: grad of {name} (/ {scale:.3g})")


def assert_logged_values_close(reference: list[dict], ours: list[dict], not_compared: set[str]) -> None:
    """Step by step, every numeric value TRL logged equals ours to rel 1e-4 (a few optimizer steps carry the first
    step's fp32 summation-order difference forward through Adam); a NaN must be a NaN."""
    assert len(ours) == len(reference)
    for step, (expected, actual) in enumerate(zip(reference, ours, strict=True)):
        for name, value in expected.items():
            if name in not_compared or not isinstance(value, (int, float)):
                continue
            if math.isnan(value):
                assert math.isnan(actual[name]), f"step {step}: {name} is {actual[name]}, TRL logged NaN"
                continue
            assert actual[name] == pytest.approx(value, rel=1e-4, abs=1e-6), f"step {step}: {name}"
