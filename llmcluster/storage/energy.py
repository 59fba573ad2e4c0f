"""A run's measured energy, logs/<run>/energy/rank_<r>.jsonl (issue 67): each GPU rank appends the joules its GPU drew
since its process started (NVML's total-energy counter, read by monitor/energy.py) at every checkpoint and at its end.
Per-rank files, so no two ranks write one file. Read by `jobs goodput` and the export's lineage and model card: the
last line of each (rank, process start) is that process's total, and the run's energy is their sum. logs/ is shared:
every line is shape-checked on read (storage/records.py). No torch here: the head node reads these."""

from __future__ import annotations

import json
from pathlib import Path

from llmcluster.storage import records

ENERGY_DIR = "energy"
REQUIRED = {"t": records.number(0), "since": records.number(0), "rank": records.integer(0),
            "joules": records.number(0)}
OPTIONAL = {"attempt": records.integer(0), "gpu": records.TEXT}


def append(logs: Path, rank: int, rec: dict) -> None:
    d = logs / ENERGY_DIR
    d.mkdir(exist_ok=True)
    with open(d / f"rank_{rank}.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def run_energy(logs: Path) -> dict | None:
    """{"joules", "kwh", "processes", "ranks"} over every rank's file, or None when no rank recorded any."""
    d = logs / ENERGY_DIR
    if not d.is_dir():
        return None
    last: dict[tuple[int, float], float] = {}
    for f in sorted(d.glob("rank_*.jsonl")):
        for r in records.read_jsonl(f, REQUIRED, OPTIONAL, warn=None):
            last[(r["rank"], r["since"])] = r["joules"]   # cumulative: the last line is the process's total
    if not last:
        return None
    joules = sum(last.values())
    return {"joules": joules, "kwh": joules / 3.6e6, "processes": len(last), "ranks": len({k[0] for k in last})}
