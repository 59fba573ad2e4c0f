"""`llmcluster storage init|status`: create the layout, and show what is in it."""

from __future__ import annotations

from pathlib import Path

from llmcluster.errors import UserError

from llmcluster.storage.layout import (ABANDONED_PREFIX, AREAS, TMP_PREFIX, Storage, disk_usage, free_bytes,
                                      read_marker, read_owner)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def init(root: Path) -> int:
    created = Storage(root).init()
    print(f"storage root {root}: {len(created)} {'directory' if len(created) == 1 else 'directories'} created")
    for d in created:
        print(f"  + {d.relative_to(root)}/")
    return 0


def status_dict(root: Path) -> dict:
    st = Storage(root)
    areas = {}
    for a in AREAS:
        p = root / a
        size, files = disk_usage(p) if p.is_dir() else (0, 0)
        areas[a] = {"exists": p.is_dir(), "bytes": size, "files": files,
                    "free_bytes": free_bytes(p)}
    runs, serving = {}, {}
    for run in st.runs():
        record = _serving_record(st, run)
        if record is not None:
            serving[run] = {k: record.get(k) for k in ("scheduler", "job_id", "state", "endpoint")}
            continue
        try:
            steps = st.checkpoint_steps(run)
        except Exception:
            continue
        complete = [s for s, _, ok in steps if ok]
        latest = complete[-1] if complete else None
        marker = read_marker(st.step_dir(run, latest)) if latest is not None else None
        runs[run] = {"checkpoints": len(steps), "complete": len(complete),
                     "incomplete": [s for s, _, ok in steps if not ok],
                     "latest_complete_step": latest,
                     "latest_bytes": (marker or {}).get("bytes"),
                     "exported": (st.model_dir(run) / "config.json").is_file(),
                     # the one writer's lock (or a dead one's, until the next writer takes it over)
                     "owner": _owner(st.run_checkpoints(run)),
                     # what interrupted attempts left (removed by the next writer, under its lock)
                     "leftovers": _dot_dirs(st.run_checkpoints(run), TMP_PREFIX),
                     # steps set aside by a roll-back, a rewrite or a failed verification: never resumed
                     # or pruned; the operator's (listed as .abandoned-<time>/step_<N>)
                     "abandoned": _abandoned(st.run_checkpoints(run))}
    return {"root": str(root), "areas": areas, "runs": runs, "serving": serving}


def _serving_record(st: Storage, name: str) -> dict | None:
    """The job record of a serving job (`serve start`: logs/<name>/job.json, kind serve, no checkpoints): it
    has a logs folder like a run but is not one, so it is listed apart."""
    from llmcluster.storage.job_record import read_record

    record = read_record(st.run_logs(name))
    if not record or record.get("kind") != "serve" or st.run_checkpoints(name).is_dir():
        return None
    return record


def _owner(run_dir: Path) -> dict | None:
    """The writer's lock record when it is an object (a file anyone who can write checkpoints/ can write)."""
    owner = read_owner(run_dir)
    return owner if isinstance(owner, dict) else None


def _dot_dirs(run_dir: Path, prefix: str) -> list[str]:
    return sorted(d.name for d in run_dir.glob(f"{prefix}*") if d.is_dir()) if run_dir.is_dir() else []


def _abandoned(run_dir: Path) -> list[str]:
    out = []
    for name in _dot_dirs(run_dir, ABANDONED_PREFIX):
        steps = sorted(d.name for d in (run_dir / name).iterdir() if d.is_dir())
        out += [f"{name}/{s}" for s in steps] or [name]
    return out


def status(root: Path, as_json: bool = False) -> int:
    import json

    from rich.table import Table

    from llmcluster.console import cell, console

    if root.exists() and not root.is_dir():
        raise UserError(f"storage root {root} is a file, not a directory: give the storage root (the directory "
                        "`llmcluster storage init` laid out)")
    if not root.is_dir():
        raise UserError(f"storage root {root} does not exist: run `llmcluster storage init --root {root}`")
    info = status_dict(root)
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    c = console()
    t = Table(title=f"storage {root}")
    for col in ("area", "size", "files", "free"):
        t.add_column(col, justify="left" if col == "area" else "right")
    for a, v in info["areas"].items():
        t.add_row(a + "/" if v["exists"] else f"{a}/ (missing)", human_bytes(v["bytes"]), str(v["files"]),
                  human_bytes(v["free_bytes"]))
    c.print(t)
    if info["runs"]:
        r = Table(title="runs")
        for col in ("run", "checkpoints", "latest complete step", "incomplete", "writer", "leftovers",
                    "exported"):
            r.add_column(col)
        for name, v in info["runs"].items():
            owner = v["owner"]
            r.add_row(*map(cell, (name, v["checkpoints"],
                                  "-" if v["latest_complete_step"] is None else v["latest_complete_step"],
                                  ", ".join(f"step_{s}" for s in v["incomplete"]) or "-",
                                  f"pid {owner.get('pid')} on {owner.get('host')}" if owner else "-",
                                  ", ".join(v["leftovers"] + v["abandoned"]) or "-",
                                  "yes" if v["exported"] else "no")))
        c.print(r)
    if info["serving"]:
        s = Table(title="serving jobs (logs/<name>/; `jobs status NAME` asks the scheduler)")
        for col in ("job", "scheduler", "job id", "last recorded state", "endpoint"):
            s.add_column(col)
        for name, v in info["serving"].items():
            s.add_row(*map(cell, (name, *(v[k] or "-" for k in ("scheduler", "job_id", "state", "endpoint")))))
        c.print(s)
    return 0
