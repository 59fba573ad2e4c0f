"""The container image (Dockerfile) against the package it ships: one dependency list, read from
pyproject.toml (torch left to the base image), and the user the Kubernetes pods run as.

No Docker here: the Dockerfile's own dependency RUN line is executed as written, with pip told `--dry-run
--no-index` (this venv already holds every dependency), so a list pip cannot resolve fails the test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO
from llmcluster.config.job import K8sSpec

DOCKERFILE = (REPO / "Dockerfile").read_text()


def _runs() -> list[str]:
    """The Dockerfile's RUN commands, continuation lines joined."""
    text = DOCKERFILE.replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", req, maxsplit=1)[0].lower().replace("_", "-")


@pytest.mark.slow   # pip resolving the list: several seconds
def test_image_installs_pyproject_dependencies_read_from_it(tmp_path):
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    printed = subprocess.run([sys.executable, REPO / "scripts" / "image_deps.py", REPO / "pyproject.toml"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert printed == [d for d in deps if _name(d) != "torch"]
    # no hand list beside it: no dependency is named with a version anywhere in the Dockerfile
    for d in deps:
        if _name(d) != "torch":
            assert not re.search(rf"(?i)\b{re.escape(_name(d))}\s*[<>=~!]", DOCKERFILE), d

    (line,) = [r for r in _runs() if "image_deps.py" in r]
    assert "pip install -r" in line and "--no-deps" not in line
    # the line as written, in a copy of what it COPYs, against this venv: `python` is this interpreter
    work = tmp_path / "ctx"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", work)
    shutil.copy(REPO / "scripts" / "image_deps.py", work / "scripts")
    cmd = line.replace("/tmp/", f"{tmp_path}/").replace("pip install", "pip install --dry-run --no-index")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    p = subprocess.run(["bash", "-ec", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Would install" not in p.stdout, p.stdout      # torch included: the constraint keeps this venv's


def test_image_user_is_the_pods_user():
    uid = K8sSpec().run_as_user
    (user,) = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user == str(uid)
    (add,) = [r for r in _runs() if "useradd" in r]
    assert f"--uid {uid}" in add and "--create-home" in add and f"--gid {uid}" in add
