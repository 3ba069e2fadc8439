"""Garbage collection during a test without re-walking the heap that existed before it.

A full collection walks every object the process tracks. Once torch, transformers and TRL are imported that is about
half a million objects, 0.6 s a pass on a 2-core machine, and a trainer run pays for several: Trainer.train() runs one
as it starts (accelerate's free_memory), transformers' continuous batching one per generate call, and the interpreter
its automatic ones. Inside `frozen_heap()` the objects that existed when it was entered sit in the permanent
generation (gc.freeze), so those passes walk only what the test allocated; on exit they go back to the oldest
generation, collectable as before. Garbage left by earlier tests is freed after the block instead of during it.
Nothing a test computes depends on when the collector runs. Where something else has frozen objects already, the
block leaves the collector to it (gc.unfreeze would release those too).
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
