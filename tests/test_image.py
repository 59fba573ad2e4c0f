"""The container image (Dockerfile) against the package it ships: one dependency list, read from
pyproject.toml (torch left to the base image) with every extra a job enables, on a torch those extras accept,
and the user the Kubernetes pods run as.

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


def _runs(dockerfile: str = DOCKERFILE) -> list[str]:
    """The Dockerfile's RUN commands, continuation lines joined."""
    text = dockerfile.replace("\\\n", " ")
    return [line[4:] for line in text.splitlines() if line.startswith("RUN ")]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", req, maxsplit=1)[0].lower().replace("_", "-")


# The extras a job enables (train.float8, ft.enabled, log.tensorboard/wandb/mlflow, hf export/import): the image
# must hold every one (k8s and test are the submitting host's and the developer's, not a job's)
JOB_EXTRAS = ("ft", "float8", "tensorboard", "wandb", "mlflow", "hf")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _arg(name: str, dockerfile: str = DOCKERFILE) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", dockerfile, re.M)[1]


def image_install(dockerfile: str, tmp_path: Path, pip: bool = True) -> list[str]:
    """The Dockerfile's dependency RUN line as written, in a copy of what it COPYs, with its ARGs in the
    environment (as `docker build` sets them) and `python` this interpreter; pip told `--dry-run --no-index`
    (this venv holds every dependency: a list pip cannot resolve fails), or not run at all (pip=False). Then
    the check: every job extra's requirements are in what the line installs. -> what it installs."""
    (line,) = [r for r in _runs(dockerfile) if "image_deps.py" in r]
    assert "pip install -r" in line and "--no-deps" not in line
    assert line.endswith("&& rm /tmp/requirements.txt /tmp/constraints.txt"), line
    work = tmp_path / "ctx"
    (work / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "pyproject.toml", work)
    shutil.copy(REPO / "scripts" / "image_deps.py", work / "scripts")
    cmd = line.rsplit("&& rm ", 1)[0].replace("/tmp/", f"{tmp_path}/")
    cmd = cmd.replace("python -m pip install", "python -m pip install --dry-run --no-index" if pip else ": pip")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "EXTRAS": _arg("EXTRAS", dockerfile)}
    p = subprocess.run(["bash", "-ec", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Would install" not in p.stdout, p.stdout      # torch included: the constraint keeps this venv's
    installed = (tmp_path / "requirements.txt").read_text().split()
    optional = PYPROJECT["optional-dependencies"]
    missing = [e for e in JOB_EXTRAS if not all(d in installed for d in optional[e] if _name(d) != "torch")]
    assert not missing, f"the image lacks the job extra(s) {missing}: {installed}"
    return installed


@pytest.mark.slow   # pip resolving the list: several seconds
def test_image_installs_pyproject_dependencies_and_every_job_extra(tmp_path):
    deps = PYPROJECT["dependencies"]
    extras = [d for e in JOB_EXTRAS for d in PYPROJECT["optional-dependencies"][e]]
    assert _arg("EXTRAS").split(",") == list(JOB_EXTRAS)
    printed = subprocess.run([sys.executable, REPO / "scripts" / "image_deps.py", REPO / "pyproject.toml",
                              _arg("EXTRAS")], capture_output=True, text=True, check=True).stdout.split()
    assert printed == list(dict.fromkeys(d for d in deps + extras if _name(d) != "torch"))
    # no hand list beside it: no dependency is named with a version anywhere in the Dockerfile
    for d in deps + extras:
        if _name(d) != "torch":
            assert not re.search(rf"(?i)\b{re.escape(_name(d))}\s*[<>=~!]", DOCKERFILE), d
    assert image_install(DOCKERFILE, tmp_path) == printed


@pytest.mark.parametrize("extra", JOB_EXTRAS)
def test_the_image_check_fails_when_an_extra_is_dropped(tmp_path, extra):
    kept = ",".join(e for e in JOB_EXTRAS if e != extra)
    dropped = DOCKERFILE.replace(f"ARG EXTRAS={_arg('EXTRAS')}\n", f"ARG EXTRAS={kept}\n")
    assert dropped != DOCKERFILE
    with pytest.raises(AssertionError, match=rf"lacks the job extra\(s\) \['{extra}'\]"):
        image_install(dropped, tmp_path, pip=False)


def test_the_base_torch_runs_ft_and_float8_and_the_floor_stays_a_variant():
    from llmcluster.floor import TORCH_FLOOR, version_tuple
    from llmcluster.train.float8 import TESTED

    base = re.fullmatch(r"pytorch/pytorch:([\d.]+)-cuda([\d.]+)-cudnn\d+-runtime", _arg("BASE"))
    assert base, _arg("BASE")
    torch_v = base[1]
    assert version_tuple(torch_v) >= (2, 7), "torchft 0.2 needs torch >= 2.7"
    assert any(torch_v.startswith(t + ".") for ts in TESTED.values() for t in ts), (torch_v, TESTED)
    assert "580.65.06" in DOCKERFILE and base[2] == "13.0"   # the driver floor CUDA 13.0 implies, said
    # the floor variant: the floor's torch, every extra but the two whose torch floors are above it
    floor = re.search(r"--build-arg BASE=pytorch/pytorch:([\d.]+)-\S+ \\\n#\s+--build-arg EXTRAS=(\S+)", DOCKERFILE)
    assert floor and version_tuple(floor[1])[:2] == TORCH_FLOOR
    assert floor[2].split(",") == [e for e in JOB_EXTRAS if e not in ("ft", "float8")]


def test_image_deps_refuses_an_unknown_extra_in_one_line():
    p = subprocess.run([sys.executable, REPO / "scripts" / "image_deps.py", REPO / "pyproject.toml", "ft,flaot8"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert "flaot8" in p.stderr and "Traceback" not in p.stderr


def test_image_user_is_the_pods_user():
    uid = K8sSpec().run_as_user
    (user,) = re.findall(r"^USER (\S+)$", DOCKERFILE, re.M)
    assert user == str(uid)
    (add,) = [r for r in _runs() if "useradd" in r]
    assert f"--uid {uid}" in add and "--create-home" in add and f"--gid {uid}" in add
