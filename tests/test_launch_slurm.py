"""`launch --scheduler slurm` on a real Slurm (2 emulated nodes, see slurm_cluster.py): the generic path.

Each job runs a small shell program on every rank under our sbatch script + srun + torchrun, so the whole
chain (rendezvous on the first node, one agent per node, signal, requeue, cancel) is the real one.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import job_state, slurm, wait_for  # noqa: F401

from conftest import assert_nowhere_under, cli_env, run_cli

pytestmark = pytest.mark.slurm


def launch(root: Path, run: str, program: str, *flags: str, env: dict | None = None) -> str:
    p = run_cli("launch", "--scheduler", "slurm", "--nodes", "2", "--root", root, "--set", f"run.name={run}",
                *flags, "--", "bash", "-c", program, check=True, env=env)
    rec = json.loads((root / "logs" / run / "job.json").read_text())
    assert rec["scheduler"] == "slurm" and f"job {rec['job_id']}" in p.stdout
    return rec["job_id"]


def test_two_node_job_status_and_logs(slurm, tmp_path):
    """Node names that resolve nowhere (NodeAddr only); a secret from the submitting environment."""
    assert subprocess.run(["getent", "hosts", "n1"], capture_output=True).returncode != 0, \
        "n1 resolves: this test is about a Slurm whose node names are not hostnames"
    root = tmp_path / "s"
    secret = secrets.token_hex(16)
    job = launch(root, "hello", 'echo "rank=$RANK of $WORLD_SIZE group=$GROUP_RANK on $SLURMD_NODENAME"; '
                 'echo "secret sha256 $(printf %s "$LLMC_TEST_SECRET" | sha256sum | cut -c1-64)"',
                 "--set", "job.secret_env=[LLMC_TEST_SECRET]", env=cli_env(LLMC_TEST_SECRET=secret))
    assert wait_for(job, ("COMPLETED",)) == "COMPLETED"
    st = json.loads(run_cli("jobs", "status", "hello", "--root", root, "--json", check=True).stdout)
    assert st["state"] == "COMPLETED" and st["job_id"] == job and st["nodes"] == "n[1-2]"
    out = run_cli("jobs", "logs", "hello", "--root", root, check=True).stdout
    lines = set(re.findall(r"rank=(\d) of (\d) group=(\d) on (n\d)", out))
    # one rank per node, both in one world of 2, each node its own torchrun group
    assert {(r, w) for r, w, _, _ in lines} == {("0", "2"), ("1", "2")}
    assert {n for *_, n in lines} == {"n1", "n2"} and {g for _, _, g, _ in lines} == {"0", "1"}
    assert re.search(r"rendezvous 127\.0\.0\.1:\d+ \(node n1\)", out), out     # n1's NodeAddr
    # the secret reached both ranks, and no file under the storage root holds it
    assert out.count(f"secret sha256 {hashlib.sha256(secret.encode()).hexdigest()}") == 2, out
    assert_nowhere_under(root, secret)
    listing = run_cli("jobs", "list", "--root", root, check=True).stdout
    assert re.search(rf"hello\s+slurm\s+{job}\s+2\s+2\s+COMPLETED", listing), listing


def test_time_limit_signal_reaches_ranks_and_requeues(slurm, tmp_path):
    """3-minute limit, USR2 90 s before it. sbatch(1): "the signal may be sent up to 60 seconds earlier
    than specified", so it arrives 30-90 s in (with 50 s before a 1-minute limit it came at 0-10 s, before
    torchrun was up). The first attempt traps USR2 on every rank and exits 75 like the trainer; the job
    requeues itself; the second attempt (SLURM_RESTART_COUNT=1) must end before its own signal: 30 s leaves
    room for torchrun's start on loaded cores."""
    root = tmp_path / "s"
    program = ('if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then '
               'trap \'echo "rank $RANK got USR2"; exit 75\' USR2; echo "rank $RANK waiting"; '
               'for i in $(seq 1500); do sleep 0.1; done; echo "rank $RANK: no signal"; exit 1; '
               'else echo "rank $RANK attempt $SLURM_RESTART_COUNT done"; fi')
    job = launch(root, "sig", program, "--time", "00:03:00", "--set", "job.signal_before_s=90")
    assert wait_for(job, ("COMPLETED",), timeout=240) == "COMPLETED"
    out = (root / "logs" / "sig" / f"slurm-{job}.out").read_text()
    assert "rank 0 got USR2" in out and "rank 1 got USR2" in out, out
    assert f"requeueing job {job} (restart 0 of 3): preempted" in out
    assert "rank 0 attempt 1 done" in out and "rank 1 attempt 1 done" in out
    assert "no signal" not in out


def test_cancel_stops_a_running_job(slurm, tmp_path):
    root = tmp_path / "s"
    job = launch(root, "long", "echo started; sleep 300")
    wait_for(job, ("RUNNING",))
    run_cli("jobs", "cancel", "long", "--root", root, check=True)
    assert wait_for(job, ("CANCELLED",), timeout=60) == "CANCELLED"
    st = json.loads(run_cli("jobs", "status", "long", "--root", root, "--json", check=True).stdout)
    assert st["state"] == "CANCELLED"
    for _ in range(30):   # slurmstepd kills the step's processes right after the state change
        left = subprocess.run(["pgrep", "-f", f"rdzv-id {job} "], capture_output=True, text=True).stdout
        if not left.strip():
            break
        time.sleep(0.5)
    assert not left.strip(), f"processes of job {job} survived the cancel: {left}"


def test_validate_collectives_across_both_nodes(slurm, tmp_path):
    """`llmcluster validate collectives` as the job's program: the bring-up check an operator runs on a new
    allocation, over the same sbatch + srun + torchrun chain (gloo on CPU, world size 2, one rank per node)."""
    root = tmp_path / "s"
    report = tmp_path / "collectives.json"
    job = launch(root, "nccl-check", f"{sys.executable} -m llmcluster validate collectives --quick -b 64K -e 256K "
                 f"-f 4 -n 2 -w 1 --report {report}", "--set", "job.env.COLUMNS=120")   # rich: a wide table
    assert wait_for(job, ("COMPLETED",), timeout=240) == "COMPLETED"
    doc = json.loads(report.read_text())
    coll = next(c for c in doc["checks"] if c["check"] == "collectives")
    assert coll["status"] == "PASS" and coll["data"]["world_size"] == 2, coll
    results = doc["results"]
    assert {r["op"] for r in results} >= {"all_reduce", "all_gather", "broadcast"}
    assert {r["bytes"] for r in results} >= {64 * 1024, 256 * 1024}
    assert all(r["wrong"] == 0 and r["busbw_GBps"] > 0 for r in results), results
    assert "busbw" in run_cli("jobs", "logs", "nccl-check", "--root", root, check=True).stdout


def test_a_downstream_evaluation_is_a_slurm_job_of_its_own(slurm, tmp_path, monkeypatch):
    """The trainer's evaluation of a checkpoint (train/downstream.py) goes to Slurm through the Scheduler object: a
    job named <run>-eval-<step>, pending while Slurm runs it and not once it has ended (issue 33). A stand-in with
    the real command line's words takes the harness's place."""
    from llmcluster.config import load_job_config
    from llmcluster.train import downstream

    real = downstream.eval_argv
    program = "import time; print('evaluated', flush=True); time.sleep(10)"
    monkeypatch.setattr(downstream, "eval_argv", lambda *a: [sys.executable, "-c", program, *real(*a)[3:]])
    logs = tmp_path / "logs" / "r"
    d = downstream.Downstream(load_job_config(None, ["run.name=r", "eval.tasks=[arc_easy]"]), tmp_path, logs, True,
                              log=lambda s: None, environ={"SLURM_JOB_ID": "1"})
    d.checkpointed(10, True)
    job = json.loads((logs / "eval" / "pending" / "step_10.json").read_text())["job_id"]
    assert "JobName=r-eval-10 " in subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                                                 text=True).stdout
    assert downstream.pending_steps(logs) == {10}
    assert wait_for(job, ("COMPLETED",)) == "COMPLETED"
    assert downstream.pending_steps(logs) == set()
    assert "evaluated" in (logs / "eval" / "job-step_10.log").read_text()


def test_ft_a_killed_group_step_is_relaunched_and_the_allocation_kept(slurm, tmp_path):
    """ft on the real Slurm (issue 37): 2 nodes, 2 replica groups of one node each, the Lighthouse a step on the
    batch host. Group 1's step dies once (its torchrun has no restarts left: --max-restarts 0); the batch script
    relaunches that step alone in the same allocation, group 0's step runs once, and the job completes without a
    requeue. The program is a stand-in that checks the Lighthouse answers at TORCHFT_LIGHTHOUSE."""
    root, marker = tmp_path / "s", tmp_path / "group1-died"
    program = ('h=${TORCHFT_LIGHTHOUSE#http://}; (exec 3<>"/dev/tcp/${h%:*}/${h##*:}") && '
               'echo "group $LLMCLUSTER_FT_GROUP of $LLMCLUSTER_FT_GROUPS on $SLURMD_NODENAME: lighthouse up"; '
               f'if [ "$LLMCLUSTER_FT_GROUP" = 1 ] && [ ! -e {marker} ]; then touch {marker}; '
               'echo "group 1 dies"; exit 3; fi; sleep 8; echo "group $LLMCLUSTER_FT_GROUP done"')
    job = launch(root, "ft-relaunch", program, "--max-restarts", "0", "--set", "ft.enabled=true",
                 "--set", "parallel.dp_replicate=2")
    # issue 65: the real slurmctld took the rendered `#SBATCH --exclusive` and holds the job's nodes for it alone
    held = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    assert "OverSubscribe=NO" in held.split(), held
    assert wait_for(job, ("COMPLETED",), timeout=240) == "COMPLETED"
    out = (root / "logs" / "ft-relaunch" / f"slurm-{job}.out").read_text()
    assert "group 1 dies" in out and "group 1 step exited with 1: relaunching it (1 of 3)" in out, out
    assert "group 0 done" in out and "group 1 done" in out and "groups exited with 0" in out
    assert "group 0 of 2 on n1: lighthouse up" in out and "group 1 of 2 on n2: lighthouse up" in out
    assert "group 0: nodes n1" in out and "(relaunch 1)" not in out.split("group 0: nodes n1")[1].split("\n")[0]
    assert out.count("group 0: nodes n1") == 1, "group 0's step was restarted"
    assert "requeue" not in out and job_state(job) == "COMPLETED"

