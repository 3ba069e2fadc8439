"""A per-module cache of built trainers that forgets them when accelerate's global state has been reset.

A Trainer's Accelerator reads accelerate's process-wide state. Building any TrainingArguments and reading its device
resets that state, and it stays empty until the next Accelerator is made, so a trainer kept from an earlier test can
find it empty ("AcceleratorState object has no attribute device"), depending on which tests a pytest worker ran in
between. The cache below drops what it holds whenever it finds the state empty, so the test rebuilds its trainers.
"""

from __future__ import annotations

from accelerate.state import AcceleratorState


def accelerate_state_alive() -> bool:
    """True while accelerate's shared state holds what the cached trainers' Accelerators were built with."""
    return bool(AcceleratorState._shared_state)


class TrainerCache(dict):
    """dict of built trainers (and what was computed with them) that empties itself after an accelerate reset."""

    def _forget_if_reset(self) -> None:
        if self and not accelerate_state_alive():
            self.clear()

    def __contains__(self, key) -> bool:
        self._forget_if_reset()
        return super().__contains__(key)

    def __getitem__(self, key):
        self._forget_if_reset()
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._forget_if_reset()
        return super().get(key, default)
