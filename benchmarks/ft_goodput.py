"""Goodput with and without per-step fault tolerance (issues 37, 52), on this machine's CPU, and ft's cost per step.

The same tiny run (2 data-parallel replicas of 1 rank each, `--steps` steps, a checkpoint every `--interval`)
loses one replica at each step of `--kills` (off the checkpoint steps: a kill on one loses the restart path a whole
interval, not the half it loses on average), in two cases:
  - kill: the replica is SIGKILLed;
  - hang: the replica is SIGSTOPped (a hung rank: nothing exits) and SIGKILLed `--hang-s` later (a watchdog; by
    default when the restart path has noticed it, dist.timeout_s).
Both paths start their processes the same way, with no torchrun agent on either side:
  - restart: the job's 2 ranks are started here directly (RANK, WORLD_SIZE, MASTER_ADDR/PORT, as torchrun's
    env:// sets them); when a rank exits (SIGKILL at once; a hang when the survivor's collective times out after
    dist.timeout_s) every rank is stopped and the job is started again, resuming from its newest checkpoint (as
    an agent's restart or a requeue would);
  - ft: `train --procs-per-node 1` with ft.enabled and parallel.dp_replicate=2: the supervisor (launch/ft_local.py)
    starts each group of one rank as that rank alone; a killed group is restarted alone and heals from its peer,
    which goes on without it after ft.timeout_s at most.
Both runs are read by `jobs goodput` (launch/goodput.py): ft's across both groups (a step committed by 1 of the 2
counts half). Every step of the failure runs is padded to --pad-s (a test hook: a tiny CPU step is ~30 ms, which no
restart could be weighed against).

`cost` is ft's price on a run without failures: the same run, unpadded, as DDP (restart path) and as 2 ft groups
(--cost-rounds of each, interleaved), each step's time (the metrics' step_time_s, the median after the warm-up) side by side, and ft's parts of a step as
the trainer times them on each rank (metrics ft_s, ft/group.py):
  - quorum: the round trip to the Lighthouse through the group's Manager before every step (torchft's
    use_async_quorum would overlap it with the forward; not used: docs/fault-tolerance.md says why);
  - copy: the gradients copied into one flat buffer before the all-reduce and back after it (DDP reduces its
    buckets in place);
  - allreduce: the cross-group all-reduce of that buffer, after the backward (DDP's overlaps the backward);
  - commit: should_commit, one more round trip among the groups.
  - membership_proof_s (case `proof`): the membership proof every member makes once per new quorum, before its
    first all-reduce (ft/membership.py: two all-gathers, a nonce and a MAC'd record, and every MAC checked), timed
    over torchft's own gloo process group between 2 members in this process (loopback) for --proof-rounds
    quorum ids: what each quorum change adds to ft's step, not paid by a step of an unchanged quorum.
What is left of the difference (`rest_s`: ft's step less DDP's less those parts) is what the ft step does besides
(its data position saved for a retry, the per-group bookkeeping) less what DDP's own all-reduce costs its step
(which ft's step does not have: it can come out negative). Figures from a loaded machine are not results: run it on a quiet one.
Prints one JSON line.
    python benchmarks/ft_goodput.py [--steps 120] [--kills 30,90] [--interval 20] [--cases kill,hang,cost]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmcluster.launch.goodput import run_goodput  # noqa: E402

TINY = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "model.vocab_size=257", "model.max_seq_len=64", "data.dataset=b", "data.seq_len=32", "train.micro_batch=4",
        "train.precision=fp32", "train.threads=1", "log.progress=false", "log.eval_interval=100000", "log.interval=1"]
PARTS = ("quorum", "copy", "allreduce", "commit")   # ft/group.py TIMINGS
WARMUP = 5   # steps left out of the cost medians
MAX_ATTEMPTS = 10   # the restart path gives up after this many (a run that cannot finish)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmcluster", *args]


def sets(*items: str) -> list[str]:
    return [a for kv in (*TINY, *items) for a in ("--set", kv)]


def kill_points(text: str, interval: int, steps: int) -> list[int]:
    """The kill steps, refused on a checkpoint step or outside the run (one line)."""
    kills = sorted(int(k) for k in text.split(",") if k.strip())
    bad = [k for k in kills if k % interval == 0 or not 0 < k < steps]
    if bad:
        raise SystemExit(f"--kills {bad}: a kill must fall inside the run and off the checkpoint steps (multiples of "
                         f"--interval {interval}): a kill there costs the restart path a whole interval")
    return kills


def step_of(root: Path, run: str) -> int:
    path = root / "logs" / run / "events.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(ln)["step"] for ln in path.read_text().splitlines() if '"event": "step"' in ln]
    return max(steps, default=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """One run's processes, started the same way on both paths (no torchrun agent)."""

    def __init__(self, root: Path, run: str, argv: list[str], pad_s: float, ranks: int, logs: Path):
        self.root, self.run, self.argv, self.ranks, self.logs = root, run, argv, ranks, logs
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "LLMCLUSTER_TESTING": "1"}
        if pad_s:
            self.env["LLMCLUSTER_INJECT_SLEEP"] = f"0:{pad_s}"
        self.procs: list[subprocess.Popen] = []
        self.starts = 0

    def start(self) -> None:
        """The restart path's ranks (`ranks` > 0) or ft's supervisor (0)."""
        self.starts += 1
        worlds = [{}] if not self.ranks else [
            {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.ranks), "LOCAL_WORLD_SIZE": str(self.ranks),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for port in [free_port()] for r in range(self.ranks)]
        self.procs = []
        for i, extra in enumerate(worlds):
            log = open(self.logs / f"{self.run}-{self.starts}-{i}.log", "w")  # noqa: SIM115 (the child's)
            self.procs.append(subprocess.Popen(self.argv, cwd=REPO, env={**self.env, **extra}, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
            log.close()

    def victim(self, group: int) -> list[int]:
        if self.ranks:   # the restart path: the replica's rank
            return [self.procs[group].pid]
        rec = json.loads((self.root / "logs" / self.run / "job.json").read_text())
        return rec["ft"]["groups"][group]["pids"]

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def chaos(r: Run, kills: list[int], sig: int, hang_s: float, group: int) -> float:
    """Run `r`; at each kill step send `sig` to the victim replica (a SIGSTOPped one is SIGKILLed `hang_s` later).
    The restart path starts its ranks again when one exits non-zero. Returns the wall seconds."""
    t0 = time.time()
    pending, watchdog = list(kills), []    # watchdog: (when, pids) of the hung replicas
    r.start()
    while True:
        time.sleep(0.05)
        if pending and step_of(r.root, r.run) >= pending[0]:
            pending.pop(0)
            pids = r.victim(group)
            signal_all(pids, sig)
            if sig == signal.SIGSTOP:
                watchdog.append((time.time() + hang_s, pids))
        for when, pids in [w for w in watchdog if w[0] <= time.time()]:
            signal_all(pids, signal.SIGKILL)
            watchdog.remove((when, pids))
        codes = [p.poll() for p in r.procs]
        if r.ranks and any(c not in (None, 0) for c in codes):   # a rank failed: the whole job starts again
            r.stop()
            watchdog.clear()
            if r.starts >= MAX_ATTEMPTS:
                raise SystemExit(f"{r.run}: {r.starts} attempts and not finished (logs: {r.logs})")
            r.start()
        elif all(c is not None for c in codes):
            r.stop()
            if any(codes) or pending:
                raise SystemExit(f"{r.run}: exited {codes} with kills {pending} left (logs: {r.logs})")
            return time.time() - t0


def figures(root: Path, run: str, wall: float) -> dict:
    g = run_goodput(root, run)
    out = {"wall_s": round(wall, 1), "goodput": round(g["goodput"], 3), "attempts": g["attempts"],
           "recomputed_steps": g["recomputed_steps"],
           **{f"{k}_s": round(v, 1) for k, v in g["badput_s"].items() if v >= 0.05}}
    if g["ft"]:
        out.update({k: g["ft"][k] for k in ("group_failures", "heals", "steps_fewer_groups")})
    return out


def step_cost(metrics: dict[str, list[list[dict]]]) -> dict:
    """ft's cost per step from the failure-free runs' metrics records (`ddp`, `ft`: each a list of runs, interleaved
    on the machine): the median step times after each run's warm-up, their ratio, ft's parts (the median over steps
    of each rank's median) and what is left."""
    steps = {path: [r for run in runs for r in run[WARMUP:]] for path, runs in metrics.items()}

    def med(recs, key):
        vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    ddp, ft = med(steps["ddp"], "step_time_s"), med(steps["ft"], "step_time_s")
    parts = {p: statistics.median(v) for p in PARTS
             if (v := [r["ft_s"][p] for r in steps["ft"] if p in r.get("ft_s", {})])}
    out = {"ddp_step_s": ddp, "ft_step_s": ft, "ratio": ft / ddp if ddp and ft else None,
           "ft_parts_s": parts}
    if ddp and ft:
        out["rest_s"] = ft - ddp - sum(parts.values())
    return {k: round(v, 4) if isinstance(v, float) else
            ({p: round(s, 4) for p, s in v.items()} if isinstance(v, dict) else v) for k, v in out.items()}


def proof_cost(rounds: int, members: int = 2) -> dict:
    """The membership proof's seconds per quorum (ft/membership.py): `members` provers, one thread each, over
    torchft's ProcessGroupGloo on loopback, each proving `rounds` quorum ids in turn; the median and the slowest
    of each round's slowest member."""
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    from torch.distributed import TCPStore
    from torchft import ProcessGroupGloo

    from llmcluster.ft.membership import Prover
    from llmcluster.launch.ft_auth import RunKey

    key = RunKey(b"b" * 64)
    ids = [key.replica_id(f"llmcluster_group_{g}:{g}-bench") for g in range(members)]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    took = [[0.0] * rounds for _ in range(members)]

    def member(r: int) -> None:
        pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
        pg.configure(f"127.0.0.1:{store.port}/bench/0", ids[r], r, members)
        prover = Prover(key, (f"127.0.0.1:{29000 + r}", f"127.0.0.1:{39000 + r}"))
        for i in range(rounds):
            q = SimpleNamespace(quorum_id=i + 1, replica_rank=r, replica_world_size=members, replica_ids=ids)
            t0 = time.perf_counter()
            prover.prove(pg, q, ids[r])
            took[r][i] = time.perf_counter() - t0

    threads = [threading.Thread(target=member, args=(r,)) for r in range(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    per_round = [max(took[r][i] for r in range(members)) for i in range(rounds)]
    return {"members": members, "rounds": rounds, "median_s": round(statistics.median(per_round), 6),
            "max_s": round(max(per_round), 6)}


def read_metrics(root: Path, run: str) -> list[dict]:
    path = root / "logs" / run / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kills", default="30,90")
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--victim-group", type=int, choices=(0, 1), default=1,
                    help="the replica killed (ft: 0 is the writer, whose role passes)")
    ap.add_argument("--cases", default="kill,hang,cost,proof")
    ap.add_argument("--proof-rounds", type=int, default=50, help="quorum ids proved (case proof)")
    ap.add_argument("--pad-s", type=float, default=0.3, help="every step of the failure runs padded to this")
    ap.add_argument("--dist-timeout-s", type=float, default=30.0, help="dist.timeout_s, both paths")
    ap.add_argument("--ft-timeout-s", type=float, default=10.0, help="ft.timeout_s")
    ap.add_argument("--hang-s", type=float, default=None, help="a hung replica is killed this long after its "
                    "SIGSTOP (default: --dist-timeout-s + 5)")
    ap.add_argument("--cost-steps", type=int, default=40)
    ap.add_argument("--cost-rounds", type=int, default=3, help="failure-free runs of each side, interleaved")
    ap.add_argument("--keep", type=Path, default=None, help="the runs' storage and logs go here (else a temp dir)")
    a = ap.parse_args()
    kills = kill_points(a.kills, a.interval, a.steps)
    cases = a.cases.split(",")
    hang_s = a.hang_s if a.hang_s is not None else a.dist_timeout_s + 5
    with tempfile.TemporaryDirectory(prefix="ft-goodput-") as tmp:
        where = a.keep or Path(tmp)
        root, src, logs = where / "storage", where / "src", where / "logs"
        src.mkdir(parents=True)
        logs.mkdir()
        for i, f in enumerate(sorted((REPO / "llmcluster").rglob("*.py"))[:20]):
            (src / f"{i}.py").write_text(f.read_text())
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        subprocess.run(cli("storage", "init", "--root", str(root)), env=env, check=True, capture_output=True)
        subprocess.run(cli("data", "prepare", "--root", str(root), "--name", "b", "--source", str(src),
                           "--tokenizer", "byte"), env=env, check=True, capture_output=True)
        base = cli("train", "-c", "llm_tiny", "--root", str(root))
        ft_sets = ("ft.enabled=true", "parallel.dp_replicate=2", "ft.min_replicas=1", "ft.join_timeout_s=2",
                   f"ft.timeout_s={a.ft_timeout_s}")

        def make(run: str, ft: bool, steps: int, pad: float) -> Run:
            items = (f"run.name={run}", f"train.steps={steps}", f"checkpoint.interval_steps={a.interval}",
                     f"dist.timeout_s={a.dist_timeout_s}", *(ft_sets if ft else ()))
            argv = base + (["--procs-per-node", "1"] if ft else []) + sets(*items)
            return Run(root, run, argv, pad, 0 if ft else 2, logs)

        out = {"steps": a.steps, "kills_at": kills, "checkpoint_every": a.interval, "victim_group": a.victim_group,
               "dist_timeout_s": a.dist_timeout_s, "ft_timeout_s": a.ft_timeout_s, "hang_s": hang_s}
        for case, sig in (("kill", signal.SIGKILL), ("hang", signal.SIGSTOP)):
            if case in cases:
                out[case] = {}
                for path in ("restart", "ft"):
                    r = make(f"{case}-{path}", path == "ft", a.steps, a.pad_s)
                    out[case][path] = figures(root, r.run, chaos(r, kills, sig, hang_s, a.victim_group))
        if "cost" in cases:
            metrics = {"ddp": [], "ft": []}
            for i in range(a.cost_rounds):   # interleaved: a machine's drift falls on both sides alike
                for path in metrics:
                    r = make(f"cost-{path}-{i}", path == "ft", a.cost_steps, 0.0)
                    chaos(r, [], signal.SIGKILL, 0, 0)
                    metrics[path].append(read_metrics(root, r.run))
            out["cost"] = step_cost(metrics)
        if "proof" in cases:
            out["membership_proof_s"] = proof_cost(a.proof_rounds)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
