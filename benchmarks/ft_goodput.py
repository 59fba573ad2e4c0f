"""Goodput of one chaos schedule with and without per-step fault tolerance (issue 37), on this machine's CPU.

The same tiny run (2 data-parallel replicas of 1 rank each, `--steps` steps, a checkpoint every `--interval`)
loses one replica to SIGKILL at each step of `--kills`:
  - restart: today's path: the run is `train --procs-per-node 2` (DDP); a killed rank stops the whole job, which
    is started again by hand (as a requeue would) and resumes from its newest checkpoint;
  - ft: `train --procs-per-node 1` with ft.enabled and parallel.dp_replicate=2: the killed group is restarted
    alone by the supervisor and heals from its peer, which never stops.
Both are read by `jobs goodput` (launch/goodput.py) from the run's events.jsonl; the ft run's figure is the
writer's (group 0's; with `--victim-group 0` the writer itself is killed and its role passes to group 1,
train/ft_writer.py), with the steps committed with fewer groups beside it. Every step is padded to STEP_PAD_S
(a test hook). Prints one JSON line.
    python benchmarks/ft_goodput.py [--steps 120] [--kills 20,70] [--interval 20] [--victim-group 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmcluster.launch.ft_local import _tree  # noqa: E402  (the supervisor's own view of a process tree)
from llmcluster.launch.goodput import run_goodput  # noqa: E402

TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "model.vocab_size=257", "model.max_seq_len=64", "data.dataset=b", "data.seq_len=32", "train.micro_batch=4",
        "train.precision=fp32", "train.threads=1", "log.progress=false", "log.eval_interval=100000"]


STEP_PAD_S = 0.3   # every step padded (a test hook, on rank 0 of every world): a tiny CPU step is ~30 ms, which no
                   # restart could be weighed against


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmcluster", *args]


def sets(*items: str) -> list[str]:
    return [a for kv in (*TINY, *items) for a in ("--set", kv)]


def step_of(root: Path, run: str) -> int:
    path = root / "logs" / run / "events.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(ln)["step"] for ln in path.read_text().splitlines() if '"event": "step"' in ln]
    return max(steps, default=0)


def chaos(root: Path, run: str, argv: list[str], kills: list[int], victim, restart: bool) -> float:
    """Run `argv`; at each kill step SIGKILL what `victim(proc)` names; with `restart`, start argv again after
    each death (the restart path). Returns the wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "LLMCLUSTER_TESTING": "1",
           "LLMCLUSTER_INJECT_SLEEP": f"0:{STEP_PAD_S}"}
    t0 = time.time()
    pending = list(kills)
    while True:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        while proc.poll() is None:
            if pending and step_of(root, run) >= pending[0]:
                pending.pop(0)
                for pid in victim(proc):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if restart:
                    break
            time.sleep(0.05)
        rc = proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # the restart path: the job's survivors go with it
        except ProcessLookupError:
            pass
        if not restart or (rc == 0 and not pending):
            return time.time() - t0


def ranks(proc) -> list[int]:
    """The restart path's victim: the last rank process of the job (torch's agent runs ranks in sessions of
    their own)."""
    return [p for p in _tree(proc.pid) if p != proc.pid][-1:]


def group_pids(root: Path, run: str, group: int):
    def victim(_proc) -> list[int]:
        rec = json.loads((root / "logs" / run / "job.json").read_text())
        return rec["ft"]["groups"][group]["pids"]
    return victim


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kills", default="20,70")
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--victim-group", type=int, choices=(0, 1), default=1,
                    help="the ft group killed (0: the writer, whose role passes)")
    a = ap.parse_args()
    kills = [int(k) for k in a.kills.split(",")]
    with tempfile.TemporaryDirectory(prefix="ft-goodput-") as tmp:
        root = Path(tmp) / "storage"
        src = Path(tmp) / "src"
        src.mkdir()
        for i, f in enumerate(sorted((REPO / "llmcluster").rglob("*.py"))[:20]):
            (src / f"{i}.py").write_text(f.read_text())
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run(cli("storage", "init", "--root", str(root)), env=env, check=True, capture_output=True)
        subprocess.run(cli("data", "prepare", "--root", str(root), "--name", "b", "--source", str(src),
                           "--tokenizer", "byte"), env=env, check=True, capture_output=True)
        common = (f"train.steps={a.steps}", f"checkpoint.interval_steps={a.interval}", "log.interval=1")
        out = {"steps": a.steps, "kills_at": kills, "checkpoint_every": a.interval, "victim_group": a.victim_group}
        base = cli("train", "-c", "llm_tiny", "--root", str(root))
        wall = chaos(root, "restart", base + ["--procs-per-node", "2"] + sets("run.name=restart", *common),
                     kills, ranks, restart=True)
        g = run_goodput(root, "restart")
        out["restart"] = {"wall_s": round(wall, 1), "goodput": round(g["goodput"], 3), "attempts": g["attempts"],
                          "recomputed_steps": g["recomputed_steps"],
                          "startup_s": round(g["badput_s"]["startup"], 1)}
        ft = sets("run.name=ft", *common, "ft.enabled=true", "parallel.dp_replicate=2", "ft.min_replicas=1",
                  "ft.join_timeout_s=2")
        wall = chaos(root, "ft", base + ["--procs-per-node", "1"] + ft, kills,
                     group_pids(root, "ft", a.victim_group), restart=False)
        g = run_goodput(root, "ft")
        out["ft"] = {"wall_s": round(wall, 1), "goodput": round(g["goodput"], 3), "attempts": g["attempts"],
                     "recomputed_steps": g["recomputed_steps"], "startup_s": round(g["badput_s"]["startup"], 1),
                     "hang_or_straggler_s": round(g["badput_s"]["hang_or_straggler"], 1), **(g["ft"] or {})}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
