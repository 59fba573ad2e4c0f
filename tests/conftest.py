"""Shared test helpers: run the real CLI in a subprocess, and free TCP ports for torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LLMCLUSTER_STORAGE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600,
            check: bool = False) -> subprocess.CompletedProcess:
    """`python -m llmcluster ARGS` as a user would run it; returns the CompletedProcess (text)."""
    proc = subprocess.run([sys.executable, "-m", "llmcluster", *map(str, args)], cwd=cwd or REPO,
                          env=env or cli_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmcluster {' '.join(map(str, args))} -> {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Bad input: exit 2, exactly one line on stderr, no traceback, and the line names what is wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    run_cli("storage", "init", "--root", root, check=True)
    return root
