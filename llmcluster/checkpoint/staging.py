"""Host buffers for async checkpoints, allocated at the first save and reused by every later one.

DCP's default staging (and `FileSystemWriter`'s without `cache_staged_state_dict`) copies the state into
fresh pageable memory at every save: a GPU rank then pays the allocation and page faults of its whole shard
each time, and device-to-host copies from pageable memory go through a bounce buffer. `cache_staged_state_dict`
keeps a pinned copy, but per writer (we make one writer per step directory) and it pins unconditionally,
which fails where there is no CUDA. Here one `ReusedStaging` per Checkpointer holds the buffers (pinned when
CUDA is available) and a writer per save stages into them; both DCP at the floor (2.6) and later use a
storage writer that is an AsyncStager as the stager.

Reuse is safe because a save first waits for the previous async write (Checkpointer.save ->
wait_pending): the writer thread has finished reading the buffers before they are overwritten.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.utils._pytree import tree_flatten


class ReusedStaging:
    def __init__(self, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffers: dict | None = None
        self.allocations = 0      # how many times the buffers were (re)made: 1 while the layout holds
        self._layout = None

    def stage(self, state: dict) -> dict:
        """`state` copied into the buffers (made or remade when the layout of the state changed)."""
        layout = _layout(state)
        if self.buffers is None or layout != self._layout:
            self.buffers = _create_cpu_state_dict(state, pin_memory=self.pin)
            self._layout, self.allocations = layout, self.allocations + 1
        return _copy_state_dict(state, self.buffers)

    def writer(self, path: Path) -> dcp.FileSystemWriter:
        """A FileSystemWriter for `path` that stages into these buffers."""
        return _Writer(path, self)


class _Writer(dcp.FileSystemWriter):
    def __init__(self, path: Path, staging: ReusedStaging):
        super().__init__(path)
        self._staging = staging

    def stage(self, state_dict: dict) -> dict:
        return self._staging.stage(state_dict)


def _layout(state: dict):
    leaves, spec = tree_flatten(state)
    return spec, tuple((type(x), tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                       for x in leaves)
