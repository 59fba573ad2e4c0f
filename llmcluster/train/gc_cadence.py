"""Python's garbage collection at a fixed step cadence (`train.gc_interval`), as torchtitan's GarbageCollection.

Automatic collection runs whenever allocations cross a threshold, which lands at a different moment on each rank:
a rank paused in a collection (long for an old generation over a large heap) holds up every collective the
others wait in, step after step at random. With an interval, automatic collection is off for the run and
every rank collects the young generations (0 and 1) at the same steps, where the stall costs each rank the same.
Generation 2 is left to the end of the run: its objects (modules, the dataset) live that long anyway.
0 keeps Python's automatic collection.
"""

from __future__ import annotations

import gc


class GarbageCollection:
    """with GarbageCollection(interval) as g: ... g.step(n) at the start of step n ..."""

    def __init__(self, interval: int):
        self.interval = interval
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> GarbageCollection:
        if self.interval:
            gc.disable()
            gc.collect(1)  # start from a clean young heap, so the first interval holds only the run's garbage
        return self

    def step(self, step: int) -> None:
        if self.interval and step > 1 and step % self.interval == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.interval and self._was_enabled:
            gc.enable()
