"""Random fault schedules against ft's invariants (issue 62; docs/fault-tolerance.md, "Invariants").

A seed draws a schedule: the group count (2-3), ft.min_replicas (1 to groups - 1: the others can always go on),
train.steps (24-40) or a train.stop_at below it, and 1-2 faults on distinct groups, each one of
  kill   SIGKILL of the group's processes (its launcher restarts it; it heals)
  stop   SIGSTOP for T s, then SIGCONT (a frozen process: its heartbeat stops too)
  hang   the training thread blocked for good while the process lives (LLMCLUSTER_TEST_FT_HANG_AT_STEP): only
         the group's watchdog (ft.step_deadline_s) ends it
  slow   SIGKILL, and the restart held T s after its checkpoint read (LLMCLUSTER_TEST_FT_SLOW_START_S: the hook
         holds every restarted group of the run alike)
at steps drawn from 3 to the end, half of them in the last 20%, with shortened ft.* timeouts. The run is a real
supervised one (`llmcluster train --procs-per-node 1`, gloo, the Lighthouse) on the tiny model, its steps slowed
to ~0.3 s so that the faults land where drawn. Every run is checked against the invariants:
  - exit 0;
  - the final step's files are the ones first sealed (byte for byte), and no step_N that verified when first seen
    changed or moved; no .abandoned-* folder;
  - FINISHED.json names the final step, and every `finished at step` / `the run finished at step` line of every
    group names the record's step and digest.
A failing seed keeps its folder and prints the command that replays it (on a busy machine the interleaving may
differ: the faults are placed by step, the timing around them is the machine's).

    python benchmarks/ft_schedules.py --seeds 0-99 --out ft_schedules.jsonl   # resumable: seeds done are skipped
    python benchmarks/ft_schedules.py --seed 7 --keep                         # one seed, its folder kept

The run is niced (os.nice 10). tests/test_ft_schedules.py runs a fixed few seeds through `run_schedule`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "model.vocab_size=257", "model.max_seq_len=64", "data.dataset=tiny", "data.seq_len=32",
        "train.micro_batch=4", "train.precision=fp32", "train.lr=3e-3", "train.warmup_steps=2",
        "log.interval=1", "log.eval_interval=1000", "log.eval_batches=2", "log.progress=false", "train.threads=1"]
# Shortened timeouts (docs/fault-tolerance.md's table): a frozen or hung group is out within ~15-20 s.
FT = ["ft.enabled=true", "ft.join_timeout_s=2", "ft.quorum_timeout_s=10", "ft.timeout_s=6", "ft.step_deadline_s=20",
      "dist.timeout_s=60", "checkpoint.interval_steps=5"]
KINDS = ("kill", "stop", "hang", "slow")
STEP_SLEEP_S = 0.3
RUN_TIMEOUT_S = 420
FINISHED = re.compile(r"finished at step (\d+),? \(?weights sha256 ([0-9a-f]{16}|not recorded[^)]*)")


@dataclasses.dataclass
class Fault:
    kind: str
    group: int
    step: int
    seconds: float = 0.0


@dataclasses.dataclass
class Schedule:
    seed: int
    groups: int
    min_replicas: int
    steps: int
    stop_at: int | None
    faults: list[Fault]

    @property
    def last(self) -> int:
        return self.stop_at or self.steps

    def items(self) -> list[str]:
        out = [f"parallel.dp_replicate={self.groups}", f"ft.min_replicas={self.min_replicas}",
               f"train.steps={self.steps}"]
        return out + ([f"train.stop_at={self.stop_at}"] if self.stop_at else [])


def draw(seed: int) -> Schedule:
    rng = random.Random(seed)
    groups = rng.choice([2, 3])
    min_replicas = rng.randint(1, groups - 1)
    steps = rng.randint(24, 40)
    stop_at = steps - rng.randint(4, 10) if rng.random() < 0.3 else None
    last = stop_at or steps
    faults = []
    for g in rng.sample(range(groups), rng.randint(1, min(2, groups))):
        late = rng.random() < 0.5   # the last 20%, where the end is decided
        step = rng.randint(max(3, int(0.8 * last)), last - 1) if late else rng.randint(3, last - 1)
        kind = rng.choice(KINDS)
        faults.append(Fault(kind, g, step, round(rng.uniform(5, 15), 1) if kind in ("stop", "slow") else 0.0))
    return Schedule(seed, groups, min_replicas, steps, stop_at, sorted(faults, key=lambda f: f.step))


# -- the run ---------------------------------------------------------------------------------------
def prepare_root(root: Path) -> Path:
    """A storage root with the tiny byte-level dataset (the tests' tiny_root), made once."""
    import sysconfig

    if (root / "datasets" / "tiny").exists():
        return root
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for args in (["storage", "init", "--root", root],
                 ["data", "prepare", "--root", root, "--name", "tiny", "--source", stdlib / "json", stdlib / "email",
                  "--tokenizer", "byte", "--val-fraction", "0.2"]):
        subprocess.run([sys.executable, "-m", "llmcluster", *map(str, args)], cwd=REPO, env=_env({}), check=True,
                       capture_output=True)
    return root


def _env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMCLUSTER_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _tree(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def _events(logs: Path) -> list[dict]:
    path = logs / "events.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _pids(logs: Path, g: int) -> list[int]:
    try:
        return list(json.loads((logs / "job.json").read_text())["ft"]["groups"][g]["pids"])
    except (OSError, ValueError, KeyError, IndexError):
        return []


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def replay_command(s: Schedule) -> str:
    return f"cd {REPO} && {sys.executable} benchmarks/ft_schedules.py --seed {s.seed} --keep"


def run_schedule(s: Schedule, root: Path, work: Path) -> dict:
    """Run one schedule; returns its result (`ok`, `problems`, seconds, the schedule). The run's output is in
    `work` (supervisor.out/err) and root/logs/<run>/."""
    run = f"sched-{s.seed}"
    logs, ckpts = root / "logs" / run, root / "checkpoints" / run
    for d in (logs, ckpts):
        shutil.rmtree(d, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    hooks = {"LLMCLUSTER_TESTING": "1", "LLMCLUSTER_INJECT_SLEEP": f"0:{STEP_SLEEP_S}"}
    hangs = [f"{f.group}:{f.step}" for f in s.faults if f.kind == "hang"]
    if hangs:
        hooks["LLMCLUSTER_TEST_FT_HANG_AT_STEP"] = ",".join(hangs)
    slow = [f.seconds for f in s.faults if f.kind == "slow"]
    if slow:
        hooks["LLMCLUSTER_TEST_FT_SLOW_START_S"] = str(max(slow))
    sets = [a for kv in (*TINY, *FT, f"run.name={run}", *s.items()) for a in ("--set", kv)]
    cmd = [sys.executable, "-m", "llmcluster", "train", "-c", "llm_tiny", "--root", str(root), "--procs-per-node",
           "1", *sets]
    t0 = time.monotonic()
    sealed: dict[int, dict[str, str]] = {}   # step -> its files when first seen complete
    problems: list[str] = []
    with open(work / "supervisor.out", "w") as out, open(work / "supervisor.err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(hooks), stdout=out, stderr=err, start_new_session=True)
        try:
            pending = [f for f in s.faults if f.kind != "hang"]
            while proc.poll() is None:
                if time.monotonic() - t0 > RUN_TIMEOUT_S:
                    problems.append(f"the run did not end within {RUN_TIMEOUT_S} s")
                    break
                step = max((e["step"] for e in _events(logs) if e["event"] == "step"), default=0)
                for f in [f for f in pending if step >= f.step]:
                    pending.remove(f)
                    pids = _pids(logs, f.group)
                    if f.kind == "stop":
                        _signal(pids, signal.SIGSTOP)
                        threading.Timer(f.seconds, _signal, (pids, signal.SIGCONT)).start()
                    else:
                        _signal(pids, signal.SIGKILL)
                for d in ckpts.glob("step_*") if ckpts.is_dir() else []:
                    n = int(d.name.rsplit("_", 1)[1]) if d.name.rsplit("_", 1)[1].isdigit() else None
                    if n is not None and n not in sealed and (d / "COMPLETE.json").is_file():
                        sealed[n] = _tree(d)
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = round(time.monotonic() - t0, 1)
    # -- the invariants --------------------------------------------------------------------------
    if proc.returncode != 0 and not problems:
        problems.append(f"exit {proc.returncode}")
    if ckpts.is_dir():
        if list(ckpts.glob(".abandoned-*")):
            problems.append(f"set aside: {[d.name for d in ckpts.glob('.abandoned-*')]}")
        for n, files in sealed.items():
            d = ckpts / f"step_{n}"
            if d.is_dir() and _tree(d) != files:
                problems.append(f"step_{n} changed after it was sealed (invariant 1)")
    if s.last not in sealed and not problems:
        problems.append(f"step_{s.last} never sealed")
    try:
        record = json.loads((ckpts / "FINISHED.json").read_text())
    except (OSError, ValueError):
        record = None
        if not problems:
            problems.append("no FINISHED.json")
    texts = [(work / "supervisor.out").read_text()]
    texts += [p.read_text() for p in sorted((logs / "ft").glob("group*.log"))] if (logs / "ft").is_dir() else []
    lines = {(int(a), b) for t in texts for a, b in FINISHED.findall(t)}
    if record is not None:
        if record.get("step") != s.last:
            problems.append(f"FINISHED.json names step {record.get('step')}, not {s.last}")
        if not lines or lines != {(s.last, record.get("weights_sha256"))}:
            want = (record.get("step"), record.get("weights_sha256"))
            problems.append(f"finished lines {sorted(lines)} != the record's {want}")
    events = _events(logs)
    return {"seed": s.seed, "ok": not problems, "problems": problems, "seconds": seconds,
            "hangs": [(e.get("group"), e["step"]) for e in events if e["event"] == "hang"],
            "failed": [e.get("group") for e in events if e["event"] == "ft_group_failed"],
            "schedule": dataclasses.asdict(s), "replay": replay_command(s)}


# -- the long run ----------------------------------------------------------------------------------
def _seeds(spec: str) -> list[int]:
    out = []
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0-99", help="seeds to run: 0-99, or 1,5,9")
    p.add_argument("--seed", type=int, help="one seed (replay)")
    p.add_argument("--out", type=Path, default=Path("ft_schedules.jsonl"), help="results, appended (resumable)")
    p.add_argument("--root", type=Path, help="a storage root with the tiny dataset (made if missing)")
    p.add_argument("--keep", action="store_true", help="keep every seed's folder (a failing one is always kept)")
    args = p.parse_args(argv)
    os.nice(10)
    seeds = [args.seed] if args.seed is not None else _seeds(args.seeds)
    done = set()
    if args.out.is_file() and args.seed is None:
        for line in args.out.read_text().splitlines():
            try:
                done.add(json.loads(line)["seed"])
            except (ValueError, KeyError):
                pass
    seeds = [seed for seed in seeds if seed not in done]
    print(f"{len(done)} seed(s) already in {args.out}; {len(seeds)} to run", flush=True)
    if not seeds:
        return 0
    base = Path(tempfile.mkdtemp(prefix="ft_schedules-"))
    root = prepare_root(args.root or base / "storage")
    failed = 0
    for seed in seeds:
        s = draw(seed)
        work = base / f"seed-{seed}"
        print(f"seed {seed}: {json.dumps(dataclasses.asdict(s))}", flush=True)
        r = run_schedule(s, root, work)
        print(f"seed {seed}: {'ok' if r['ok'] else 'FAILED ' + '; '.join(r['problems'])} ({r['seconds']} s)",
              flush=True)
        if not r["ok"]:
            failed += 1
            print(f"  kept {work} and {root / 'logs' / f'sched-{seed}'}; replay: {r['replay']} (on a busy machine "
                  "the interleaving may differ)", flush=True)
        elif not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            for area in ("logs", "checkpoints"):
                shutil.rmtree(root / area / f"sched-{seed}", ignore_errors=True)
        if args.seed is None:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
