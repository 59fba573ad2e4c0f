"""DCP's reader and load planner made data-only (see safe_load.py for what is checked and why).

A module of its own because both subclass DCP's classes, and importing DCP costs ~1.2 s (DTensor, sympy):
safe_load.py, which every trainer imports, loads this only when a checkpoint is actually read.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from llmcluster.checkpoint.safe_load import METADATA, load_data, read_metadata_file
from llmcluster.distributed import compat


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata_file(Path(self.path) / METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are read with `weights_only=True`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_data(value)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, but weights_only=True
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_state(state: dict, path: Path, no_dist: bool = False) -> None:
    """dcp.load with the safe reader and planner: the one way this project reads a DCP checkpoint."""
    compat.dcp_load(state, SafeFileSystemReader(path), planner=DataOnlyLoadPlanner(), no_dist=no_dist)
