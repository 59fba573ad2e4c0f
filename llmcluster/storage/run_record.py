"""A run's identity, logs/<run>/run.json: written by the metrics sinks at each attempt's start (monitor/tracking.py),
read by `eval` to find the run's tracking sinks. One writer and one reader, here in storage beside the run's other
records (docs/architecture.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcluster.storage.owned import read_text, replace_atomically

RUN_JSON = "run.json"


def write(log_dir: Path, info: dict) -> None:
    replace_atomically(log_dir / RUN_JSON, json.dumps(info, indent=1) + "\n")   # no planted temp name followed


def read_own(log_dir: Path) -> tuple[dict | None, str | None]:
    """run.json of a run, when it is the caller's own file: (its record, None), else (None, why not). Its
    config names the tracking URIs `eval` would send the caller's credentials to ($MLFLOW_TRACKING_TOKEN, W&B's
    key), so a run.json someone else wrote (or a link to one) in a shared logs/ is not followed (storage/owned.py)."""
    path = log_dir / RUN_JSON
    text, why = read_text(path)
    if text is None:
        return None, (f"{path} {why}" + (": its tracking sinks are not used" if "owned by" in why else "")
                      if why else None)   # absent: not a run of ours (an export from elsewhere), nothing to say
    try:
        info = json.loads(text)
    except ValueError:
        return None, f"{path} is not JSON"
    return (info, None) if isinstance(info, dict) else (None, f"{path} is not a run record")
