"""A queued Slurm serving job checks at start what `serve start` left in logs/<name>/ (issue 65): its own directory
(not a link, not another user's), the guard it wrote (sha256 on the script), the key file the caller's own. The
rendered script's checks run here by bash against planted directories, up to the server's start (no node, no
engine); two users where this runs as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from test_serve_start import serve_job

VICTIM, ATTACKER = 64011, 64012     # uids of no account: setpriv runs as them (root only)


def preamble(job) -> str:
    """The Slurm script up to the server's start (its node address and port are scontrol's), then a marker."""
    from llmcluster.serve.start import render_slurm

    text = render_slurm(job, None, None)
    return text[:text.index("# the node's address")] + "echo STARTED\n"


def lay_out(job, owner: int | None = None) -> None:
    """What `serve start` leaves: logs/<name>/ (0750), its launch dir with the guard (0400), the key (0600)."""
    from llmcluster.serve import auth

    job.launch_dir.mkdir(parents=True)
    (job.launch_dir / auth.GUARD_FILE).write_text(auth.guard_source())
    (job.launch_dir / auth.GUARD_FILE).chmod(0o400)
    (job.logs / auth.KEY_FILE).write_text("the-victims-key\n")
    (job.logs / auth.KEY_FILE).chmod(0o600)
    if owner is not None:
        for d, dirs, files in os.walk(job.logs):
            for p in [d, *(os.path.join(d, f) for f in dirs + files)]:
                os.chown(p, owner, owner)


def run(script: str, uid: int | None = None) -> subprocess.CompletedProcess:
    pre = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
    return subprocess.run([*pre, "bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin"}, check=False)


def refused(p: subprocess.CompletedProcess, needle: str) -> None:
    assert p.returncode == 2 and "STARTED" not in p.stdout, p
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith("[llmcluster] refusing to serve: ") and needle in line, line


@pytest.fixture
def root():
    """A storage root every uid can walk to (pytest's tmp_path is root's own, 0700)."""
    base = Path(tempfile.mkdtemp(prefix="serve-queued-"))
    base.chmod(0o755)
    (base / "logs").mkdir()
    (base / "logs").chmod(0o2775)      # the storage level's layout without the sticky bit: the case
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_a_job_whose_files_are_its_own_starts(root):
    job = serve_job(root, scheduler="slurm")
    lay_out(job)
    p = run(preamble(job))
    assert p.returncode == 0 and p.stdout.strip() == "STARTED", p


@pytest.mark.parametrize("plant", ["logs link", "guard changed", "key link", "key fifo"])
def test_a_planted_directory_guard_or_key_is_refused(root, plant):
    from llmcluster.serve import auth

    job = serve_job(root, scheduler="slurm")
    lay_out(job)
    theirs = root / "theirs"
    if plant == "logs link":      # the victim's logs/<name> renamed away, a link to a copy in its place
        shutil.copytree(job.logs, theirs, symlinks=True)
        job.logs.rename(root / "logs" / "moved")
        job.logs.symlink_to(theirs)
        needle = "is not this user's own directory"
    elif plant == "guard changed":
        guard = job.launch_dir / auth.GUARD_FILE
        guard.chmod(0o600)
        guard.write_text(auth.guard_source() + "\nimport os  # the attacker's\n")
        needle = "is not the guard serve start"
    else:
        key = job.logs / auth.KEY_FILE
        key.unlink()
        (theirs.write_text("the-attackers-key\n"), key.symlink_to(theirs)) if plant == "key link" else os.mkfifo(key)
        needle = "is not this user's own file"
    refused(run(preamble(job)), needle)


@pytest.mark.skipif(os.geteuid() != 0, reason="two users need root (setpriv)")
def test_another_users_directory_in_place_of_the_jobs_is_refused(root):
    """The issue's attack with two users: a group member renames the victim's logs/<name> and puts their own in
    its place, holding the very guard the script expects (its sha256 matches) and their key. The victim's queued
    job refuses to start; the victim's own directory passes as the victim."""
    job = serve_job(root, scheduler="slurm")
    lay_out(job, owner=VICTIM)
    script = preamble(job)
    assert run(script, VICTIM).stdout.strip() == "STARTED"
    job.logs.rename(root / "logs" / "moved")
    lay_out(job, owner=ATTACKER)
    refused(run(script, VICTIM), "is not this user's own directory")
