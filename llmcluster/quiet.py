"""Import noise, not news (issue 69): what a library logs while it is imported and that says nothing about the run.
On a CPU torchao logs that its CUDA extensions cannot load (`Failed to load …/_C_mxfp8…so`, `_C_cutlass_90a`),
and torch warns that torchao registers an Enum with pytree the deprecated way; both came before the tool's first
line on the QLoRA path. Silenced for the import only: anything logged later is shown."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_torchao_import(cuda: bool = False):
    """Around a torchao import: its loader's failures kept quiet unless on CUDA (where they mean a kernel is
    missing), and torch's pytree deprecation warning always."""
    quiet = [logging.getLogger("torch.utils._pytree")] + ([] if cuda else [logging.getLogger("torchao")])
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
