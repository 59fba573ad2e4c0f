"""`llmcluster jobs goodput RUN`: where a run's allocated time went, from its own logs/<run>/events.jsonl.

Each attempt (a process group of the run: a torchrun restart, a requeue, a resume by hand) runs from its
process's start to its last line: its exit, or for a killed attempt its last event or per-step heartbeat.
The time between one attempt's end and the next one's start is `queued_s`, reported apart: it is neither
productive nor badput of the job. The attempts' own time, `wall_s`, is split by the event that closes each
interval between two consecutive lines:
  - a training step's interval (up to its heartbeat, or to the eval/save that starts at that step) is
    productive if the step reached a checkpoint the run went on from (the next attempt's restored step; the
    last attempt's last durable checkpoint, or all of it if it completed), else `lost_progress`;
  - up to init_done, restore_start and a step at or below the attempt's starting step: `startup`;
  - restore_start → restore_end: `checkpoint_restore`; save_start → save_end: `checkpoint_save` (what
    training was blocked: an async save's background write overlaps training); eval_start → eval_end: `eval`;
  - a step that took over SLOW × the run's median step: the excess is `hang_or_straggler` (a collective
    waiting on a slow or stuck rank, a stalled read), the median stays productive or lost; the excess of an
    attempt's first step (warm-up: allocator, kernels, compile) is `startup`;
  - the last step boundary → a failed exit: `failure` (the step in flight, and noticing the failure);
  - anything else (shutdown after the last checkpoint, an unknown event): `other`.
So productive_s + sum(badput_s) == wall_s exactly. No torch here: the head node runs this.

An ft run (per-step fault tolerance, ft/group.py) also records ft_quorum, ft_heal, ft_group_failed, ft_straggler and
ft_lighthouse_lost. They split no interval, but the goodput is the run's across all its groups (each holds 1/n of
the allocation): a step committed by k of the n groups (the quorum recorded before it) is productive for k/n of its
interval, and each missing group's 1/n is badput: `startup` once it failed (ft_group_failed since it was last in a
quorum: a dead group's restart, its process start, model build and heal, until it is in a quorum again), else
`hang_or_straggler` (dropped as a straggler, or away with no exit recorded: hung or cut off). A slow step during
which a group failed (ft_group_failed) has its excess in `failure` (the step in flight and noticing the failure,
ft.timeout_s at most), as the planner charges it (plan/checkpoint.py). `ft` sums the records: the groups' failures,
the heals (count, bytes, seconds of the heal step's quorum as recorded), the groups dropped as stragglers and the
steps committed with fewer groups than the run's.
"""

from __future__ import annotations

import bisect
import statistics
from pathlib import Path

from llmcluster.errors import UserError
# the attempts and ft's records have their home in storage/events.py (the lineage counts attempts too)
from llmcluster.storage.energy import run_energy
from llmcluster.storage.events import EVENTS, FT_PREFIX, HANG, attempts, read_events, trained_attempts  # noqa: F401

BUCKETS = ("startup", "checkpoint_restore", "checkpoint_save", "eval", "lost_progress", "hang_or_straggler",
           "failure", "other")
BAR = {"productive": "#", "startup": "s", "checkpoint_restore": "r", "checkpoint_save": "c", "eval": "e",
       "lost_progress": "l", "hang_or_straggler": "h", "failure": "f", "other": "o"}   # the text bar's letters
PLOT = "goodput.png"   # what --plot DIR writes
SLOW = 3.0   # a step over this many median steps counts its excess as hang_or_straggler
_STEP_END = {"step", "eval_start", "save_start", "checkpointed"}   # closes an interval of training at `step`
_SPANS = {"eval_end": "eval", "save_end": "checkpoint_save", "restore_end": "checkpoint_restore",
          "init_done": "startup", "restore_start": "startup"}


def _start_step(att: list[dict]) -> int | None:
    """The step an attempt trained from (after its restore), or None if it died before init_done."""
    return next((e["step"] for e in att if e["event"] in ("init_done", "restore_end")), None)


def _kept(atts: list[list[dict]], i: int) -> float:
    """The last step of attempt i whose progress the run kept: the step the next attempt that got going
    restored; for the last attempt, all of them if it completed, else its last durable checkpoint."""
    for later in atts[i + 1:]:
        s = _start_step(later)
        if s is not None:
            return s
    att = atts[i]
    if any(e["event"] == "exit" and e.get("reason") == "completed" for e in att):
        return float("inf")
    return max((e.get("ckpt", e["step"]) for e in att if e["event"] == "checkpointed"), default=0)


def _step_intervals(att: list[dict]) -> list[float]:
    """The times between consecutive step heartbeats of one attempt (each one training step)."""
    return [b["t"] - a["t"] for a, b in zip(att, att[1:])
            if a["event"] == b["event"] == "step" and b["step"] == a["step"] + 1]


def ft_summary(events: list[dict]) -> dict | None:
    ft = [e for e in events if e["event"].startswith(FT_PREFIX)]
    if not ft:
        return None
    quorums = [(e["step"], e["groups"]) for e in ft if e["event"] == "ft_quorum" and isinstance(e.get("groups"), int)]
    full = _run_groups(ft)
    last = max(e["step"] for e in events)
    # a quorum recorded at step s serves the steps after s, up to the next one
    fewer = sum(max(0, nxt - s) for (s, g), (nxt, _g) in zip(quorums, quorums[1:] + [(last, 0)]) if g < full)
    number = (int, float)
    # One heal may write two lines (the receiver's: the whole heal; the sender's: the bytes and its own time of the
    # send): counted once, with the receiver's seconds where both were written.
    heals: dict[tuple, dict] = {}
    for e in (e for e in ft if e["event"] == "ft_heal"):
        h = heals.setdefault((e["step"], e.get("group")), {"seconds": {}, "bytes": 0})
        if isinstance(e.get("seconds"), number):
            h["seconds"][e.get("side")] = e["seconds"]
        if isinstance(e.get("bytes"), number):
            h["bytes"] += e["bytes"]
    heal_s = sum(s.get("receiver", max(s.values(), default=0)) for s in (h["seconds"] for h in heals.values()))
    return {"groups": full, "group_failures": sum(e["event"] == "ft_group_failed" for e in ft),
            "heals": len(heals), "heal_s": heal_s, "heal_bytes": sum(h["bytes"] for h in heals.values()),
            "steps_fewer_groups": fewer, "stragglers_dropped": sum(e["event"] == "ft_straggler" for e in ft),
            "lighthouse_lost": sum(e["event"] == "ft_lighthouse_lost" for e in ft),
            # invariant 3: the group that hung is named (its watchdog's `hang`); invariant 4: the tail a launcher
            # waited after the run's end before stopping the groups still running
            "hangs": sorted(e["group"] for e in events if e["event"] == HANG and isinstance(e.get("group"), int)),
            "end_tail_s": sum(e["waited_s"] for e in ft if e["event"] == "ft_groups_stopped_after_end"
                              and isinstance(e.get("waited_s"), number))}


def _run_groups(ft: list[dict]) -> int:
    """The run's replica groups: ft_quorum's `of` (records before it: the most groups seen in a quorum)."""
    return max((e.get("of") or e.get("groups") or 0 for e in ft if e["event"] == "ft_quorum"), default=0)


def _ids(quorum: dict) -> set[str]:
    """The groups of an ft_quorum record (`llmcluster_group_<g>`), as text."""
    return {str(r).rsplit("_", 1)[-1] for r in quorum.get("replica_ids") or []}


class _Groups:
    """Which groups committed each step of an ft run, and why the others were away (module docstring)."""

    def __init__(self, ft: list[dict]):
        self.n = _run_groups(ft)
        self.quorums: dict[int, list[dict]] = {}   # per attempt, in step order (a retry's quorum after the first)
        for e in sorted((e for e in ft if e["event"] == "ft_quorum" and isinstance(e.get("groups"), int)),
                        key=lambda e: (e["step"], e["t"])):
            self.quorums.setdefault(e["attempt"], []).append(e)
        self.leaves = sorted((e for e in ft if e["event"] in ("ft_group_failed", "ft_straggler")), key=lambda e: e["t"])

    def away(self, attempt: int, step: int, t: float) -> dict[str, float]:
        """The shares of the interval of `step` (ending at `t`) that the groups not in its quorum cost, by bucket."""
        qs = self.quorums.get(attempt, [])
        i = bisect.bisect_right([q["step"] for q in qs], step - 1) - 1   # a quorum recorded at s serves s+1, ...
        if i < 0 or qs[i]["groups"] >= self.n:
            return {}
        missing = [g for g in map(str, range(self.n)) if g not in _ids(qs[i])] if _ids(qs[i]) else []
        missing = (missing + [None] * self.n)[:self.n - qs[i]["groups"]]   # by count where the ids are not known
        out: dict[str, float] = {}
        for g in missing:   # away since the last quorum it was in (with no ids: the last full one)
            since = max((q["t"] for q in qs[:i] if (g in _ids(q) if g else q["groups"] >= self.n)), default=-1.0)
            why = [e for e in self.leaves if since < e["t"] <= t and (g is None or str(e.get("group")) == g)]
            bucket = "startup" if why and why[-1]["event"] == "ft_group_failed" else "hang_or_straggler"
            out[bucket] = out.get(bucket, 0.0) + 1 / self.n
        return out

    def failed_in(self, t0: float, t1: float) -> bool:
        return any(t0 < e["t"] <= t1 for e in self.leaves if e["event"] == "ft_group_failed")


def goodput(events: list[dict]) -> dict:
    ft = ft_summary(events)
    groups = _Groups([e for e in events if e["event"].startswith(FT_PREFIX)])
    atts = trained_attempts(events)
    if not atts:
        raise UserError("no attempt that trained is recorded for this run (events.jsonl is written by the "
                        "trainer's rank 0; starts that did nothing are left out)")
    bad = dict.fromkeys(BUCKETS, 0.0)
    productive = wall = queued = 0.0
    step_times = [dt for att in atts for dt in _step_intervals(att)]
    med = statistics.median(step_times) if step_times else None
    recomputed = 0
    prev_end = None
    for i, att in enumerate(atts):
        start, end = att[0]["t"], att[-1]["t"]
        wall += end - start
        if prev_end is not None:
            queued += max(0.0, start - prev_end)
        prev_end = end
        s0 = _start_step(att)
        first = s0 if s0 is not None else float("inf")
        kept = _kept(atts, i)
        lost_steps = set()
        for a, b in zip(att, att[1:]):
            dt = b["t"] - a["t"]
            ev, k = b["event"], b["step"]
            if ev in _STEP_END and k > first:
                if ev == "step" and med and dt > SLOW * med:     # the step's excess over a median step
                    bad["startup" if k == first + 1 else "failure" if groups.failed_in(a["t"], b["t"])
                        else "hang_or_straggler"] += dt - med
                    dt = med
                if k <= kept:
                    for bucket, share in groups.away(b["attempt"], k, b["t"]).items():   # ft: k of n groups
                        bad[bucket] += dt * share
                        productive -= dt * share
                    productive += dt
                else:
                    bad["lost_progress"] += dt
                    lost_steps.add(k)
            elif ev in _STEP_END:
                bad["startup"] += dt
            elif ev in _SPANS:
                bad[_SPANS[ev]] += dt
            elif ev == "exit" and b.get("reason") in ("failed", "fatal"):
                bad["failure"] += dt
            else:
                bad["other"] += dt
        recomputed += len(lost_steps)
    total_bad = sum(bad.values())
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall if wall > 0 else 0.0,
            "queued_s": queued, "badput_s": bad,
            "badput": {k: v / wall if wall > 0 else 0.0 for k, v in bad.items()},
            "attempts": len(atts), "recomputed_steps": recomputed,
            "step_time_s": statistics.median(step_times) if step_times else None,
            "unaccounted_s": wall - productive - total_bad, "ft": ft}


def _spans(att: list[dict], start: str, end: str) -> list[float]:
    """Durations from each `start` event to the next `end` event of one attempt."""
    out, t0 = [], None
    for e in att:
        if e["event"] == start:
            t0 = e["t"]
        elif e["event"] == end and t0 is not None:
            out.append(e["t"] - t0)
            t0 = None
    return out


def model(events: list[dict], result: dict) -> dict | None:
    """What the planner's Young/Daly model predicts for this run, fed with the run's own measurements:
    C the median save, the restart R the median time from a later attempt's start to its init_done (the
    restore within it), M the attempts' wall time per interruption (every attempt that did not complete),
    τ the checkpoint interval: the widest step gap between two durable checkpoints (a preemption's or the
    last step's save comes early) × the median step. None without an interruption or two checkpoints."""
    from llmcluster.plan.checkpoint import badput_model

    atts = attempts(events)
    saves = [d for a in atts for d in _spans(a, "save_start", "save_end")]
    ckpts = sorted({e.get("ckpt", e["step"]) for e in events if e["event"] == "checkpointed"})
    gap = max((b - a for a, b in zip(ckpts, ckpts[1:])), default=0)
    starts = [d for a in atts[1:] for d in _spans(a, "attempt_start", "init_done")]
    interrupted = sum(1 for a in atts if not any(e["event"] == "exit" and e.get("reason") == "completed" for e in a))
    if not (saves and gap and starts and interrupted and result["step_time_s"]):
        return None
    inputs = {"write_s": statistics.median(saves), "restart_s": statistics.median(starts),
              "read_s": statistics.median([d for a in atts for d in _spans(a, "restore_start", "restore_end")] or [0]),
              "mtbf_s": result["wall_s"] / interrupted, "interval_s": gap * result["step_time_s"]}
    bad = badput_model(**inputs)
    return {"goodput": max(0.0, 1 - sum(bad.values())), "badput": bad, "inputs": inputs}


def run_goodput(root: Path, run: str) -> dict:
    from llmcluster.storage.layout import Storage

    path = Storage(root).run_logs(run) / EVENTS
    if not path.is_file():
        raise UserError(f"run {run!r}: no {path} (runs record events.jsonl since issue 28's trainer)")
    events = read_events(path)
    result = {"run": run, **goodput(events)}
    result["model"] = model(events, result)
    result["energy"] = run_energy(path.parent)   # GPU ranks' NVML counters (storage/energy.py); None: not measured
    return result


def write_textfile(result: dict, path: Path) -> None:
    """The breakdown as a Prometheus textfile (node_exporter's textfile collector reads it; atomic)."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    reg = CollectorRegistry()
    secs = Gauge("llmcluster_goodput_seconds", "Attempts' wall time of a run by where it went", ["run", "bucket"],
                 registry=reg)
    for k in ("productive", *BUCKETS):
        secs.labels(result["run"], k).set(result["productive_s"] if k == "productive" else result["badput_s"][k])
    secs.labels(result["run"], "queued").set(result["queued_s"])
    Gauge("llmcluster_goodput_ratio", "Productive share of the attempts' wall time", ["run"],
          registry=reg).labels(result["run"]).set(result["goodput"])
    write_to_textfile(str(path), reg)


def render(result: dict, plan: dict | None = None, width: int = 60, label: str = "plan") -> str:
    """A table of seconds and shares (beside a prediction's shares, headed `label`), and a stacked bar
    (one letter per bucket) of the wall time."""
    wall = result["wall_s"]
    rows = [("productive", result["productive_s"])] + [(k, result["badput_s"][k]) for k in BUCKETS]
    lines = [f"run {result['run']}: {result['attempts']} attempt(s), wall {wall:.1f} s, "
             f"goodput {result['goodput']:.1%} (queued apart: {result['queued_s']:.1f} s)"]
    head = f"  {'bucket':<20}{'seconds':>10}{'share':>9}" + (f"{label:>9}" if plan else "")
    lines.append(head)
    for k, v in rows:
        share = v / wall if wall > 0 else 0.0
        p = "" if not plan else f"{(plan['goodput'] if k == 'productive' else plan['badput'].get(k, 0.0)):>9.2%}"
        lines.append(f"  {k:<20}{v:>10.2f}{share:>9.1%}{p}")
    bar = "".join(BAR[k] * round(width * v / wall if wall > 0 else 0) for k, v in rows)
    lines.append(f"  [{bar[:width]:<{width}}]  " + ", ".join(f"{c} {k}" for k, c in BAR.items()))
    if en := result.get("energy"):
        lines.append(f"  energy: {en['kwh']:.3f} kWh measured (NVML energy counters of {en['processes']} GPU rank "
                     f"process(es), {en['ranks']} rank(s))")
    if ft := result.get("ft"):
        lines.append(f"  ft: {ft['groups']} groups, {ft['group_failures']} group failure(s), "
                     f"{ft.get('stragglers_dropped', 0)} dropped as straggler(s), {ft['heals']} heal(s) "
                     f"({ft['heal_bytes'] / 1e6:.1f} MB, {ft['heal_s']:.2f} s), {ft['steps_fewer_groups']} step(s) "
                     "committed with fewer groups"
                     + (f"; hung: group(s) {', '.join(map(str, ft['hangs']))}" if ft.get("hangs") else "")
                     + (f"; {ft['end_tail_s']:.1f} s waited on groups still running after the run's end"
                        if ft.get("end_tail_s") else ""))
    return "\n".join(lines)


def plot(result: dict, out_dir: Path, plan: dict | None = None, label: str = "plan") -> Path:
    """goodput.png: one stacked bar of shares for the run, beside the plan's prediction when given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    cols = {"measured": {"productive": result["goodput"], **result["badput"]}}
    if plan:
        cols[label] = {"productive": plan["goodput"], **plan["badput"]}
    fig, ax = plt.subplots(figsize=(5, 4))
    bottom = dict.fromkeys(cols, 0.0)
    for k in ("productive", *BUCKETS):
        vals = [cols[c].get(k, 0.0) * 100 for c in cols]
        ax.bar(list(cols), vals, bottom=[bottom[c] for c in cols], label=k)
        for c, v in zip(cols, vals):
            bottom[c] += v
    ax.set_ylabel("% of attempts' wall time")
    ax.set_title(f"{result['run']}: goodput")
    ax.legend(fontsize=7)
    path = out_dir / PLOT
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

