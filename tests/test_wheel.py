"""The wheel carries its presets, example plans and monitoring files: build it, install it in a fresh venv
outside the repo and run the CLI from an empty directory, where no `configs/` or `monitoring/` lies beside.

The fresh venv reuses this venv's installed dependencies (torch, pydantic, ...) through a .pth line rather
than downloading them again; llmcluster itself comes only from the wheel (the test checks where it imports
from)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.slow


def _run(cmd: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} -> {p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLMCLUSTER_STORAGE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # A copy of the tracked files, so the build leaves nothing in the checkout.
    src = tmp / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        s, d = REPO / rel, src / rel
        if s.is_symlink() or not s.is_file():
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_bytes(s.read_bytes())
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp / "dist", src], tmp, env)
    (wheel,) = (tmp / "dist").glob("llmcluster-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    purelib = Path(subprocess.run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                   "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    # this venv's dependencies, after the new venv's own site-packages (which will hold the wheel)
    (purelib / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps",
          wheel], tmp, env)
    return venv, env


def test_wheel_install_runs_train_plan_and_monitor_from_an_empty_directory(installed, tmp_path):
    venv, env = installed
    work = tmp_path / "empty"
    work.mkdir()
    py, cli = venv / "bin" / "python", venv / "bin" / "llmcluster"
    where = _run([py, "-c", "import llmcluster; print(llmcluster.__file__)"], work, env).stdout.strip()
    assert where.startswith(str(venv)), where  # the wheel's copy, not the checkout's

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = work / "storage"
    _run([cli, "storage", "init", "--root", root], work, env)
    _run([cli, "data", "prepare", "--root", root, "--name", "tiny", "--source", stdlib / "json",
          "--tokenizer", "byte", "--val-fraction", "0.2"], work, env)
    train = _run([cli, "train", "--config", "llm_tiny", "--root", root, "--set", "data.dataset=tiny",
                  "--set", "train.steps=2", "--set", "log.eval_batches=1", "--set", "log.progress=false"],
                 work, env)
    assert "finished step 2" in train.stdout + train.stderr, train.stdout
    assert (root / "checkpoints" / "llm-tiny" / "step_2").is_dir()

    plan = _run([cli, "plan", "seed-a100-7b"], work, env)
    assert "7" in plan.stdout and plan.stdout.strip()

    mon = yaml.safe_load(_run([cli, "monitor", "config", "--nodes", "gpu01"], work, env).stdout)
    rules = [Path(f) for f in mon["rule_files"]]
    assert [f.name for f in rules] == ["recording.yml", "alerts.yml"]
    assert all(f.is_file() and str(f).startswith(str(venv)) for f in rules), rules  # shipped in the wheel
    assert sorted(p.name for p in work.iterdir()) == ["storage"]  # nothing else beside the run
