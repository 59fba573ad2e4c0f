"""`llmcluster provision`: what it renders, that Ansible and ansible-lint accept it, and its topology.

The real applies (Slurm up from the rendered roles) are in test_provision_apply.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible_helpers import read_rendered

from llmcluster.cli import main
from llmcluster.config.cluster_load import load_cluster
from llmcluster.config.hostlist import expand_hostlist
from llmcluster.provision import render, slurm

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# the on-premise specs: a cloud spec (a `cloud:` section) is refused by provision, SkyPilot sets up its nodes
# (tests/test_launch_skypilot.py checks the refusal)
EXAMPLES = sorted(p.name for p in (REPO / "clusters").glob("*.yaml") if "\ncloud:" not in p.read_text())
LEVELS = ["os", "gpu", "fabric", "storage", "scheduler", "container", "ml", "monitoring"]


def provision(tmp_path: Path, cluster: str, *extra: str) -> Path:
    out = tmp_path / "out"
    assert main(["provision", "--cluster", cluster, "--out", str(out), *extra]) == 0
    return out


def test_examples_exist():
    assert {"seed-a100.yaml", "h200-8x.yaml", "rtx4090-box.yaml"} <= set(EXAMPLES)


def test_provision_never_imports_torch():
    code = ("import sys, llmcluster.provision.render, llmcluster.provision.slurm, llmcluster.cli.provision; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_pinned_driver_runs_the_pinned_cuda():
    from llmcluster.validate.result import PASS
    from llmcluster.validate.stack import driver_cuda_status

    v = render.versions()
    for key in ("driver", "cuda", "nccl", "doca_ofed", "slurm", "torch"):
        assert v[key], key
    assert v["driver"].startswith(v["driver_branch"] + ".")
    assert driver_cuda_status(v["driver"], v["cuda"])[0] == PASS


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_rendered_project_passes_syntax_check_and_lint(tmp_path, example):
    out = provision(tmp_path, str(REPO / "clusters" / example))
    site = yaml.safe_load((out / "site.yml").read_text())
    assert [p["roles"][0]["tags"] for p in site] == [[lvl] for lvl in LEVELS]
    syntax = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "site.yml"], cwd=out,
                            capture_output=True, text=True, timeout=300)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    lint = subprocess.run([str(BIN / "ansible-lint"), "--offline", "--nocolor", "site.yml"], cwd=out,
                          capture_output=True, text=True, timeout=600)
    assert lint.returncode == 0, lint.stdout[-4000:] + lint.stderr[-4000:]
    assert "0 failure(s), 0 warning(s)" in lint.stdout + lint.stderr


def test_seed_inventory_and_vars(tmp_path):
    out = provision(tmp_path, str(REPO / "clusters" / "seed-a100.yaml"))
    inv = read_rendered(out / "inventory.yml")["all"]["children"]
    assert list(inv["head"]["hosts"]) == ["head01"]
    assert inv["head"]["hosts"]["head01"] == {"node_gpus": 0, "node_hcas": 0, "node_fabric_link": "none",
                                              "node_nvswitch": False}
    nodes = inv["nodes"]["hosts"]
    assert list(nodes) == [f"gpu{i:02d}" for i in range(1, 9)]
    assert nodes["gpu03"] == {"node_gpus": 4, "node_hcas": 4, "node_fabric_link": "ib", "node_nvswitch": False}
    assert set(inv["storage"]["children"]) == {"head", "nodes"}
    v = read_rendered(out / "group_vars" / "all" / "cluster.yml")
    assert v["provision_head"] == "head01" and v["provision_scheduler"] == "slurm"
    # spec strings are `!unsafe` (tests/test_spec_injection.py), but not the empty one: Ansible reads that as null
    text = (out / "group_vars" / "all" / "cluster.yml").read_text()
    assert "provision_head: !unsafe 'head01'" in text and "provision_slurm_image: ''\n" in text
    assert v["scheduler_slurm_partition"] == "gpu"
    assert v["scheduler_slurm_nodes"] == [{"names": "gpu[01-08]", "hosts": list(nodes), "cpus": 64,
                                           "memory_mb": int(512 * 1024 * 0.9), "gpus": 4, "gpu_type": "a100-80gb"}]
    assert v["scheduler_slurm_gres"] == [{"names": "gpu[01-08]", "gpus": 4, "gpu_type": "a100-80gb"}]
    # Lustre at /storage: one mount, and datasets bound read-only on the workers
    assert [(m["path"], m["backend"]) for m in v["storage_mounts"]] == [("/storage", "lustre"),
                                                                       ("/storage/datasets", "bind")]
    assert v["storage_sources"]["/storage"] is None          # site data: the storage level asserts it is set
    assert "datasets/code" in v["storage_areas"] and "checkpoints" in v["storage_areas"]
    pinned = yaml.safe_load((out / "group_vars" / "all" / "versions.yml").read_text())["provision_versions"]
    assert pinned == render.versions()
    assert yaml.safe_load((out / "files" / "cluster.yaml").read_text())["name"] == "seed"
    prom = yaml.safe_load((out / "files" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"][0] == "gpu01:9400"
    for f in ("alerts.yml", "recording.yml", "grafana/node-gpus.json"):
        assert (out / "roles" / "monitoring" / "files" / f).is_file()


def test_h200_nvswitch_count_only_placeholders_and_kubernetes(tmp_path, capsys):
    out = provision(tmp_path, str(REPO / "clusters" / "h200-8x.yaml"))
    assert "nodes.hosts is not set" in capsys.readouterr().err
    inv = read_rendered(out / "inventory.yml")["all"]["children"]
    assert list(inv["nodes"]["hosts"]) == ["h200-01", "h200-02", "h200-03", "h200-04"]
    assert inv["nodes"]["hosts"]["h200-01"]["node_nvswitch"] is True      # 8 NVLink GPUs: HGX with NVSwitch
    v = read_rendered(out / "group_vars" / "all" / "cluster.yml")
    assert v["provision_scheduler"] == "k8s"
    assert v["storage_mounts"][0]["backend"] == "weka"


def test_cpu_only_node_has_no_gpu_or_fabric_work(tmp_path):
    spec = tmp_path / "one.yaml"
    spec.write_text(f"name: one\nnodes: {{hosts: localhost}}\nhardware: {{gpu: none, gpus_per_node: 0}}\n"
                    f"storage: {{root: {tmp_path}/storage}}\nscheduler: {{default: slurm}}\n")
    out = provision(tmp_path, str(spec))
    inv = read_rendered(out / "inventory.yml")["all"]["children"]
    assert inv["head"]["hosts"] == {"localhost": None}      # its own head: vars live under nodes
    assert inv["nodes"]["hosts"]["localhost"] == {"node_gpus": 0, "node_hcas": 0, "node_fabric_link": "none",
                                                  "node_nvswitch": False}
    v = read_rendered(out / "group_vars" / "all" / "cluster.yml")
    assert v["scheduler_slurm_partition"] == "cpu" and v["scheduler_slurm_gres"] == []
    assert v["scheduler_slurm_switches"] == [] and v["storage_mounts"] == []
    assert v["scheduler_slurm_nodes"][0]["cpus"] is None    # the node's own count, from Ansible's facts
    provision(tmp_path, str(spec), "--scheduler", "local")
    v = read_rendered(out / "group_vars" / "all" / "cluster.yml")
    assert v["provision_scheduler"] == "local"


def test_refuses_a_foreign_non_empty_dir(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    rc = main(["provision", "--cluster", str(REPO / "clusters" / "seed-a100.yaml"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "refusing to overwrite" in err
    assert (out / "notes.txt").read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # a directory provision wrote itself is rendered again in place
    again = provision(tmp_path, str(REPO / "clusters" / "seed-a100.yaml"))
    (again / "roles" / "stale.txt").write_text("x")
    provision(tmp_path, str(REPO / "clusters" / "seed-a100.yaml"), "--set", "scheduler.slurm.partition=big")
    assert not (again / "roles" / "stale.txt").exists()
    assert read_rendered(again / "group_vars" / "all" / "cluster.yml")["scheduler_slurm_partition"] == "big"
    # the spec installed on the hosts is the one rendered, overrides included, and loads again
    installed = load_cluster(str(again / "files" / "cluster.yaml")).spec
    assert installed == load_cluster(str(REPO / "clusters" / "seed-a100.yaml"), ["scheduler.slurm.partition=big"]).spec


def test_bad_cluster_is_one_line(tmp_path, capsys):
    rc = main(["provision", "--cluster", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cluster file not found" in err
    assert not (tmp_path / "o").exists()


def planner_switches_per_rail(spec) -> int:
    """Straight from the planner: every rail is its own tree unless one switch takes all of them."""
    ft = slurm.fat_tree_for(spec)
    return 1 if ft.total == 1 else ft.total // ft.rails


@pytest.mark.parametrize("nodes,tiers", [(8, 1), (64, 1), (100, 2), (2100, 3)])
def test_topology_is_the_planners_fat_tree(nodes, tiers):
    spec = load_cluster(str(REPO / "clusters" / "seed-a100.yaml"), [f"nodes.count={nodes}"]).spec
    hosts, _ = render.host_names(spec)
    switches, desc = slurm.topology_switches(spec, hosts)
    assert slurm.fat_tree_for(spec).tiers == tiers and f"{tiers} tier(s)" in desc
    assert len(switches) == planner_switches_per_rail(spec)
    leaves = [s for s in switches if "nodes" in s]
    seen = [h for s in leaves for h in expand_hostlist(s["nodes"])]
    assert sorted(seen) == sorted(hosts)                     # every node on exactly one leaf
    if tiers > 1:
        assert max(len(expand_hostlist(s["nodes"])) for s in leaves) <= spec.topology.switch_radix // 2
        names = {s["name"] for s in switches}
        parents = [s for s in switches if "switches" in s]
        assert all(set(s["switches"].split(",")) <= names for s in parents)
        reached = {c for s in parents for c in s["switches"].split(",")}
        assert {s["name"] for s in leaves} <= reached         # no leaf left out of the tree
