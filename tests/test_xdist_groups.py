"""`make test` on xdist workers keeps the tests that share one thing the machine has once (the real Slurm, the
session's vLLM server) on one worker (conftest.xdist_group, `--dist loadgroup`). pytest 9.2 silently broke that
with pytest-xdist 3.8 (pytest-dev/pytest-xdist#1386: the tests were spread round-robin and the Slurm tests of two
workers cancelled each other's jobs); pyproject pins pytest below 9.2. This fails if a pytest/xdist pair in the
venv stops grouping again."""

from __future__ import annotations

import os
import subprocess
import sys


def test_loadgroup_keeps_a_group_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\n"
        "pytestmark = pytest.mark.xdist_group('shared')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_where(i):\n"
        "    with open(os.environ['WHERE'], 'a') as f:\n"
        "        f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    where = tmp_path / "where.txt"
    # the timeout guards a hang, it times nothing: two workers' start took 5 s on a quiet machine, > 120 s under load
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--dist", "loadgroup", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "WHERE": str(where)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers = where.read_text().split()
    assert len(workers) == 6 and len(set(workers)) == 1, workers
