"""Imported only by the fork server of preloaded_engines.py (it is one of ENGINE_MODULES), never by a test process:
each engine process forked from the server reseeds torch's and numpy's default generators from the OS, as a freshly
spawned interpreter seeds them, so forked engines never share a random stream (Python's random reseeds itself after
a fork). An engine that sampled without the trainer's seed would then differ from run to run, as a spawned one would.
"""

from __future__ import annotations

import os

import numpy
import torch


def fresh_generators() -> None:
    torch.seed()
    numpy.random.seed()


os.register_at_fork(after_in_child=fresh_generators)
