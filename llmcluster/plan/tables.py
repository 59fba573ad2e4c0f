"""The planner's dated data files (llmcluster/plan/data/*.yaml), read once."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from llmcluster.config.load import read_yaml

DATA_DIR = Path(__file__).resolve().parent / "data"


@lru_cache(maxsize=None)
def _read(path: str) -> dict[str, Any]:
    return read_yaml(path, "planner data")


def hardware() -> dict[str, Any]:
    return _read(str(DATA_DIR / "hardware.yaml"))


def calibration() -> dict[str, Any]:
    return _read(str(DATA_DIR / "calibration.yaml"))


def prices(path: str | None = None) -> dict[str, Any]:
    """The bundled prices, or the user's file (its keys replace the bundled ones)."""
    bundled = _read(str(DATA_DIR / "prices.yaml"))
    if path is None:
        return bundled
    return {**bundled, **_read(str(Path(path).expanduser()))}


def published_runs() -> dict[str, Any]:
    return _read(str(DATA_DIR / "published_runs.yaml"))


def step_model_constants() -> dict[str, Any]:
    return _read(str(DATA_DIR / "step_model.yaml"))


def validation_runs() -> dict[str, Any]:
    """Validation-only runs (plan/validation.py); the step model's fit never reads this file."""
    return _read(str(DATA_DIR / "validation_runs.yaml"))


def attention_kernels() -> dict[str, Any]:
    """Published attention-kernel rates (plan/attention.py)."""
    return _read(str(DATA_DIR / "attention_kernels.yaml"))


def finetune_runs() -> dict[str, Any]:
    """Published fine-tuning runs under their own conditions (plan/finetune.py's golden rows, issue 55)."""
    return _read(str(DATA_DIR / "finetune_runs.yaml"))
