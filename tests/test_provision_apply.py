"""The rendered Ansible project applied for real to this machine (`-c local`, as root), bringing up a Slurm.

Kept apart from the tests' own 2-node Slurm (scripts/slurm_up.sh: /etc/slurm, ports 6817/17001+, /run/munge):
every path, port and the munge socket are overridden with `-e` into a temporary directory, and the daemons are
stopped by their own PID files afterwards. Nothing is mocked: this machine simply has no GPU and no HCA, so the
gpu and fabric levels must skip, and no systemd, so the daemons are started directly.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from ansible_helpers import read_rendered

from llmcluster.cli import main
from llmcluster.config.cluster_load import load_cluster
from llmcluster.provision import slurm

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture
def base(request):
    if os.geteuid() != 0:
        pytest.fail("the provision apply tests need root (they install packages and start munged/slurmctld/slurmd)")
    # not pytest's tmp_path: it is 0700, and slurmctld (SlurmUser=slurm) and munged must traverse it
    d = Path(tempfile.mkdtemp(prefix="llmc-provision-"))
    for sub in ("", "munge", "slurm"):
        (d / sub).mkdir(exist_ok=True)
        (d / sub).chmod(0o755)
    yield d
    daemons = d / "slurm" / "etc" / "llmcluster-daemons"
    for name in ("slurmd", "slurmctld", "munged"):
        if daemons.exists():
            subprocess.run([str(daemons), name, "stop"], capture_output=True, timeout=60)
    shutil.rmtree(d, ignore_errors=True)


def local_overrides(d: Path, port: int) -> Path:
    """What differs from a real cluster on a shared test machine (see the module docstring)."""
    v = {
        "ansible_become": False,                       # already root; there is no sudo here
        "ansible_python_interpreter": "/usr/bin/python3",   # the system Python has apt's bindings
        "provision_cluster_file": f"{d}/etc/cluster.yaml",
        "provision_venv": str(VENV),                   # this venv already holds the pinned torch + llmcluster
        "ml_wheel_dir": f"{d}/wheels",                 # the shipped wheel lands here (llmcluster==version is satisfied)
        "os_profile_file": f"{d}/etc/profile.sh", "os_limits_file": f"{d}/etc/limits.conf",
        "scheduler_conf_dir": f"{d}/slurm/etc", "scheduler_state_dir": f"{d}/slurm/state",
        "scheduler_spool_dir": f"{d}/slurm/spool", "scheduler_log_dir": f"{d}/slurm/log",
        "scheduler_run_dir": f"{d}/slurm/run", "scheduler_ctld_port": port, "scheduler_slurmd_port": port + 1,
        "scheduler_munge_key": f"{d}/munge/etc/munge.key", "scheduler_munge_run_dir": f"{d}/munge/run",
        "scheduler_munge_state_dir": f"{d}/munge/lib", "scheduler_munge_log_dir": f"{d}/munge/log",
    }
    path = d / "local.yml"
    path.write_text(yaml.safe_dump(v))
    return path


def apply(project: Path, overrides: Path, *args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([str(VENV / "bin" / "ansible-playbook"), "-c", "local", "-e", f"@{overrides}", *args,
                        "site.yml"], cwd=project, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    return p


def recap(out: str) -> dict[str, int]:
    line = [ln for ln in out.splitlines() if re.match(r"^\S+\s+: ok=", ln)][-1]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


def slurm_cmd(conf: Path, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env={**os.environ, "SLURM_CONF": str(conf)}, capture_output=True, text=True,
                          timeout=timeout)


def test_apply_one_local_node_brings_up_slurm_and_is_idempotent(base):
    spec = base / "cluster.yaml"
    spec.write_text(f"name: localtest\nnodes: {{hosts: localhost}}\nhardware: {{gpu: none, gpus_per_node: 0}}\n"
                    f"storage: {{root: {base}/storage}}\nscheduler: {{default: slurm, slurm: {{partition: debug}}}}\n")
    project = base / "project"
    assert main(["provision", "--cluster", str(spec), "--out", str(project)]) == 0
    overrides = local_overrides(base, 6917)
    first = apply(project, overrides)
    assert "gpu level skipped on localhost: no GPUs" in first.stdout
    assert "fabric level skipped on localhost: no HCAs" in first.stdout
    assert "time sync skipped on localhost: no systemd" in first.stdout           # this machine is a container
    assert "monitoring services skipped on localhost: no systemd" in first.stdout
    assert "enroot + pyxis skipped on localhost: no scheduler.slurm.image" in first.stdout
    assert recap(first.stdout)["changed"] > 0
    # the storage layout: datasets readable by the worker group, the other areas writable
    root = base / "storage"
    for area, mode in (("datasets", 0o2755), ("datasets/code", 0o2755), ("checkpoints", 0o3775),
                       ("logs", 0o3775), ("models", 0o3775), ("scratch", 0o3775)):
        st = (root / area).stat()
        assert st.st_mode & 0o7777 == mode, area
        assert st.st_gid == __import__("grp").getgrnam("llmusers").gr_gid
    conf = base / "slurm" / "etc" / "slurm.conf"
    assert "SlurmctldPort=6917" in conf.read_text()
    # a job runs (its prolog runs our `validate stack --quick` first)
    deadline = time.monotonic() + 120
    while "idle" not in slurm_cmd(conf, "sinfo", "-h", "-o", "%T").stdout and time.monotonic() < deadline:
        time.sleep(1)
    job = slurm_cmd(conf, "srun", "-N", "1", "-t", "2", "hostname", timeout=300)
    assert job.returncode == 0, job.stderr
    assert job.stdout.strip() == socket.gethostname()
    # nothing left to do the second time
    second = apply(project, overrides)
    assert recap(second.stdout)["changed"] == 0, second.stdout[-4000:]
    assert "gpu level skipped" in second.stdout
    # a node whose prolog check fails is drained with the reason (here: the checks cannot run at all)
    broken = base / "broken.yml"
    broken.write_text(yaml.safe_dump({"scheduler_llmcluster": str(base / "missing" / "llmcluster")}))
    apply(project, overrides, "-e", f"@{broken}", "--tags", "scheduler")
    sub = slurm_cmd(conf, "sbatch", "--parsable", "-t", "2", "--wrap", "hostname")
    assert sub.returncode == 0, sub.stderr
    deadline, state = time.monotonic() + 180, ""
    while time.monotonic() < deadline:
        state = slurm_cmd(conf, "sinfo", "-h", "-N", "-o", "%T|%E").stdout.strip()
        if state.startswith("drain"):
            break
        time.sleep(1)
    slurm_cmd(conf, "scancel", sub.stdout.strip())
    # the prolog drains it (the job's epilog, failing the same way, keeps the first reason)
    assert state.startswith("drain") and "llmcluster prolog: llmcluster not installed" in state, state


@pytest.mark.parametrize("overrides", [[], ["nodes.count=100"]], ids=["seed", "seed-100-nodes-2-tiers"])
def test_seed_slurm_conf_is_accepted_by_slurmctld(base, overrides):
    """The seed's rendered slurm.conf/gres.conf/topology.conf under a real slurmctld (the role starts it); at
    100 nodes the fat-tree has two tiers (leaves under every spine)."""
    project = base / "project"
    seed = REPO / "clusters" / "seed-a100.yaml"
    sets = [a for o in overrides for a in ("--set", o)]
    assert main(["provision", "--cluster", str(seed), "--out", str(project), *sets]) == 0
    # the seed's node names resolve on the cluster (DNS or ansible_host); here they point at this machine
    hosts = read_rendered(project / "inventory.yml")["all"]["children"]["nodes"]["hosts"]
    (base / "addresses.yml").write_text(yaml.safe_dump(
        {"nodes": {"hosts": {h: {"ansible_host": "127.0.0.1"} for h in hosts}}}))
    apply(project, local_overrides(base, 6927), "-i", "inventory.yml", "-i", str(base / "addresses.yml"),
          "--tags", "scheduler", "--limit", "head01")
    conf = base / "slurm" / "etc" / "slurm.conf"
    assert "UP" in slurm_cmd(conf, "scontrol", "ping").stdout
    topo = slurm_cmd(conf, "scontrol", "show", "topology").stdout
    spec = load_cluster(str(seed), overrides).spec
    ft = slurm.fat_tree_for(spec)
    per_rail = 1 if ft.total == 1 else ft.total // ft.rails
    assert len(re.findall(r"^SwitchName=", topo, re.M)) == per_rail, topo
    first = list(hosts)[0]
    if not overrides:
        assert per_rail == 1 and "Nodes=gpu[01-08]" in topo
    else:
        assert (ft.tiers, per_rail) == (2, 6)                # 4 leaves of 32 nodes, 2 spines over all of them
        spines = re.findall(r"^SwitchName=spine\d+ Level=1 .*Nodes=seed-\[001-100\] Switches=(\S+)$", topo, re.M)
        assert spines == ["leaf01,leaf02,leaf03,leaf04"] * 2, topo
    node = slurm_cmd(conf, "scontrol", "show", "node", first).stdout
    assert "Gres=gpu:a100-80gb:4" in node and "CPUTot=64" in node and "RealMemory=471859" in node, node
    assert slurm_cmd(conf, "sinfo", "-h", "-o", "%P %D").stdout.split() == ["gpu*", str(len(hosts))]
