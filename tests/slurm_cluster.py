"""A real 3-node Slurm on this machine for the launch tests: `from slurm_cluster import slurm  # noqa: F401`.

scripts/slurm_up.sh installs Debian's slurm + munge if missing, starts munged, slurmctld and three slurmd
(n1, n2, n3 on 127.0.0.1: the 2-node jobs run on n1-n2, n3 is ft's spare node), once per test module; scripts/slurm_down.sh stops them at the end. It needs root:
when it cannot run, the tests FAIL (CI runs as root; a skipped Slurm test would hide a broken launcher).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Slurm's non-terminal states, typed out here rather than imported: tests don't trust what they check.
# SIGNALING shows up while `scancel --signal` / the time-limit signal is being delivered.
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "SPECIAL_EXIT", "STOPPED")


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests need root (scripts/slurm_up.sh installs and starts slurmctld/slurmd)")
    up = subprocess.run(["bash", str(REPO / "scripts" / "slurm_up.sh")], capture_output=True, text=True,
                        timeout=600)
    if up.returncode != 0:
        pytest.fail(f"scripts/slurm_up.sh failed ({up.returncode}):\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}")
    yield
    subprocess.run(["bash", str(REPO / "scripts" / "slurm_down.sh")], capture_output=True, timeout=120)


def job_state(job_id: str) -> str:
    """The state straight from Slurm (not through our code), so tests don't trust what they check."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    for word in out.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


def wait_for(job_id: str, states: tuple[str, ...], timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = job_state(job_id)
        if st in states:
            return st
        if st not in ACTIVE:
            raise AssertionError(f"job {job_id} ended as {st}, waiting for {states}")
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {job_state(job_id)} after {timeout}s (wanted {states})")
