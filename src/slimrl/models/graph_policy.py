"""When a shape's layer passes are worth capturing (models/layer_graphs.py): a capture costs an eager pass and the
capture itself, and pays back only through replays of the same shape before its graphs are let go.

A shape whose graphs were let go having replayed fewer times than they were captured is captured later the next
time it comes back: after 4 sightings, then 8, up to 32. One whose graphs paid for themselves goes back to 2. GRPO's
padded lengths change from step to step; on the demo (40 steps, 30 layers) the passes were captured 780 times and
replayed 300 with a fixed 2, and its training phase ran no faster than eagerly (docs/benchmarks.md, twenty-ninth
session). Fixed shapes (W1, W3) are captured at their second sighting as before.
"""

from __future__ import annotations

CAPTURE_AFTER = 2  # a key runs eagerly until it is seen this many times, then it is captured and replayed
MAX_BACKOFF = 4  # a shape let go unpaid for waits at most CAPTURE_AFTER * 2**MAX_BACKOFF sightings
COLD_SHAPES = 1024  # shapes remembered as unpaid before that memory starts again


class ShapeUses:
    """Per shape: its passes' captures and replays while it keeps graphs, and how many times in a row its graphs went
    unpaid."""

    def __init__(self):
        self.kept: dict = {}  # shape -> [captures, replays] since its graphs were made
        self.cold: dict = {}  # shape -> times in a row its graphs were let go with fewer replays than captures

    def capture_after(self, shape) -> int:
        """Sightings of a key of this shape before it is captured."""
        return CAPTURE_AFTER << min(self.cold.get(shape, 0), MAX_BACKOFF)

    def captured(self, shape) -> None:
        self.kept.setdefault(shape, [0, 0])[0] += 1

    def replayed(self, shape) -> None:
        self.kept.setdefault(shape, [0, 0])[1] += 1

    def let_go(self, shape) -> None:
        """The shape's graphs go: note whether they paid for their captures (a replay each, on average)."""
        captures, replays = self.kept.pop(shape, (0, 0))
        if replays < captures:
            if len(self.cold) >= COLD_SHAPES and shape not in self.cold:
                self.cold.clear()
            self.cold[shape] = self.cold.get(shape, 0) + 1
        elif replays:
            self.cold.pop(shape, None)
