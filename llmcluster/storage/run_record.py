"""A run's identity, logs/<run>/run.json: written by the metrics sinks at each attempt's start (monitor/tracking.py),
read by `eval` to find the run's tracking sinks. One writer and one reader, here in storage beside the run's other
records (docs/architecture.md).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

RUN_JSON = "run.json"


def write(log_dir: Path, info: dict) -> None:
    tmp = log_dir / f".{RUN_JSON}.tmp"
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, log_dir / RUN_JSON)     # readers never see half a record


def read_own(log_dir: Path) -> tuple[dict | None, str | None]:
    """run.json of a run, when it is the caller's own file: (its record, None), else (None, why not). Its
    config names the tracking URIs `eval` would send the caller's credentials to ($MLFLOW_TRACKING_TOKEN, W&B's
    key), so a run.json someone else wrote (or a link to one) in a shared logs/ is not followed. Opened once
    (no link followed) and checked on the open file, so it cannot be swapped between the check and the read."""
    try:
        fd = os.open(log_dir / RUN_JSON, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None, None     # not a run of ours (an export from elsewhere): nothing to say
    except OSError as e:
        return None, f"{log_dir / RUN_JSON} cannot be read ({e.strerror or e})"
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None, (f"{log_dir / RUN_JSON} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}): "
                          "its tracking sinks are not used")
        try:
            info = json.loads(f.read())
        except (OSError, ValueError):
            return None, f"{log_dir / RUN_JSON} is not JSON"
    return (info, None) if isinstance(info, dict) else (None, f"{log_dir / RUN_JSON} is not a run record")
