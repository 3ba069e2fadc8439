"""Never train on, or save, non-finite numbers.

Each optimizer step, before the weights are written: were the micro-batches' losses finite, and is the gradient
finite? The losses are folded into one device flag as they come (no host sync per micro-batch); at the step's last
micro-batch the flag and the gradient norm are read once, together. What happens then is the config's
`on_nonfinite`: "raise" stops with `NonFiniteError` (the weights, the optimizer state and the last checkpoint stay as
they were), "skip" drops the step's gradient so the optimizer leaves every weight as it was, and training goes on.
"""

from __future__ import annotations

import math

import torch

ON_NONFINITE = ("raise", "skip")


class NonFiniteError(RuntimeError):
    """A loss, gradient, log-prob or weight that slimrl was about to use or save is NaN or infinite."""


def check_on_nonfinite(value: str) -> None:
    if value not in ON_NONFINITE:
        raise ValueError(
            f"on_nonfinite must be 'raise' (stop before the optimizer step, weights untouched) or 'skip' (drop that "
            f"step's update and go on), got {value!r}."
        )


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: the local shard of an FSDP2-sharded DTensor, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def gradient_norm(parameters: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """The L2 norm of the gradients that exist (fp32, on their device; no host sync), or None if none do. Under
    FSDP2 it is the norm of this process's shards: finite exactly when they are (the flags are reduced across
    processes after)."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return None
    norms = torch._foreach_norm(grads, 2.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device, torch.float32) for n in norms]), 2.0)


class StepFiniteness:
    """The finiteness of one optimizer step's losses, accumulated on the device across its micro-batches."""

    def __init__(self) -> None:
        self._loss_ok: torch.Tensor | None = None  # bool [], all losses of the step so far finite

    def add_loss(self, loss: torch.Tensor) -> None:
        ok = torch.isfinite(loss.detach()).all()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok

    def verdict(self, parameters: list[torch.nn.Parameter], reduce=None) -> tuple[bool, str]:
        """(finite, what was not) for the step, and reset. One host sync. `reduce(tensor)` combines the flags of all
        processes (so every rank takes the same decision); None on a single process."""
        norm = gradient_norm(parameters)
        device = norm.device if norm is not None else (self._loss_ok.device if self._loss_ok is not None else "cpu")
        loss_ok = torch.ones((), dtype=torch.bool, device=device) if self._loss_ok is None else self._loss_ok
        grad_ok = torch.ones((), dtype=torch.bool, device=device) if norm is None else torch.isfinite(norm)
        flags = torch.stack([loss_ok.to(device), grad_ok]).float()  # 1.0 = finite
        if reduce is not None:
            flags = reduce(flags)
        loss_fine, grad_fine = (bool(v) for v in (flags >= 1.0).tolist())  # the one sync
        self._loss_ok = None
        problems = []
        if not loss_fine:
            problems.append("the loss")
        if not grad_fine:
            value = float(norm) if norm is not None else math.nan
            problems.append(f"the gradient (norm {value})")
        return loss_fine and grad_fine, " and ".join(problems)


def drop_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """No gradient at all: torch's optimizers then leave these parameters, and their state, untouched."""
    for p in parameters:
        p.grad = None


def nonfinite_tensors(named: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]], limit: int = 5) -> list[str]:
    """Names of the floating-point tensors holding a NaN or infinity (at most `limit`); one host sync per device."""
    items = [(n, t) for n, t in (named.items() if isinstance(named, dict) else named) if t.is_floating_point()]
    if not items:
        return []
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in items:
        by_device.setdefault(tensor.device, []).append((name, tensor))
    bad = []
    for group in by_device.values():
        flags = torch.stack([torch.isfinite(t.detach()).all() for _, t in group]).tolist()
        bad += [name for (name, _), ok in zip(group, flags, strict=True) if not ok]
    return bad[:limit]


def refuse_nonfinite_weights(model: torch.nn.Module, what: str, trainable_only: bool = False) -> None:
    """Raise NonFiniteError naming the first non-finite parameters instead of writing them to disk."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not trainable_only]
    bad = nonfinite_tensors(named)
    if bad:
        raise NonFiniteError(
            f"Refusing to save {what}: these weights hold NaN or infinite values: {', '.join(bad)}. Saving them "
            "would overwrite a good model with a broken one. Resume from the last good checkpoint, and train with "
            "on_nonfinite='raise' (the default) or 'skip' so a non-finite step never reaches the weights."
        )
