"""Acceptance: one file, clusters/seed-a100.yaml, drives plan, validate stack, launch --dry-run (Slurm and every
Kubernetes form) and monitor config, and each output reflects it (partition, GPUs per node, namespace, image, hosts).

NVML cannot exist on this CPU machine: the GPU-count check is fed a fake NVML (the one stand-in here)."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import assert_one_line_error, cli_inprocess, run_cli

REPO = Path(__file__).resolve().parent.parent
SEED = REPO / "clusters" / "seed-a100.yaml"
HOSTS = [f"gpu{i:02d}" for i in range(1, 9)]
IMAGE = "registry.example.com/llmcluster:0.1"


def ok(capsys, *args):
    p = cli_inprocess(capsys, *args)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_plan_on_the_seed(capsys):
    r = json.loads(ok(capsys, "plan", "seed-a100-7b", "--cluster", SEED, "--json"))
    assert r["cluster"] == {"name": "seed", "gpu": "A100-80GB", "nodes": 8, "gpus_per_node": 4, "fabric": "ib-ndr",
                            "nics_per_node": 4}
    assert r["parallel"]["world"] == 32 and r["memory"]["gpu_capacity_bytes"] == 80e9
    assert "32 GPUs on seed (8 x 4 A100-80GB)" in ok(capsys, "plan", "seed-a100-7b", "--cluster", SEED)


def test_validate_stack_on_the_seed(capsys, tmp_path, no_scheduler_probe):
    # the seed expects 4 x A100 per node: this CPU machine (no driver, no NCCL, no NVML) is a FAIL, exit 1,
    # each missing piece on its own line saying what was expected; a 1-GPU machine FAILs the GPU count
    p = cli_inprocess(capsys, "validate", "stack", "--cluster", SEED, "--report", tmp_path / "r.json")
    assert p.returncode == 1 and "validate: FAIL" in p.stdout, p.stdout + p.stderr
    assert "expecting 4 x A100-80GB per node; cluster seed" in p.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    items = {i["name"]: i for c in doc["checks"] for i in c["items"]}
    if not Path("/proc/driver/nvidia/version").exists():
        for name in ("nvidia driver", "nccl", "gpus"):
            assert items[name]["status"] == "FAIL", items[name]
            assert "cluster seed expects 4 x A100-80GB per node" in items[name]["detail"]
    j = cli_inprocess(capsys, "validate", "stack", "--cluster", SEED, "--json")
    assert j.returncode == 1 and json.loads(j.stdout)["status"] == doc["status"] == "FAIL"
    mounts = next(i for c in doc["checks"] for i in c["items"] if i["name"] == "storage mounts")
    assert "/storage" in mounts["detail"] + mounts["value"]          # the seed's storage.root, not ./storage


class FakeNVML:
    """Three GPUs where the seed has four."""
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 0

    def nvmlDeviceGetCount(self): return 3
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return "NVIDIA A100-SXM4-80GB"
    def nvmlDeviceGetEccMode(self, h): return (1, 1)
    def nvmlDeviceGetTotalEccErrors(self, h, a, b): return 0
    def nvmlDeviceGetRetiredPages(self, h, c): return []
    def nvmlDeviceGetPersistenceMode(self, h): return 1


def test_validate_gpu_count_comes_from_the_seed():
    from llmcluster.validate.spec import load_spec
    from llmcluster.validate.stack import check_gpus

    item = check_gpus(load_spec(str(SEED)), FakeNVML()).items[0]
    assert item.status == "FAIL" and item.detail == "expected 4"


def test_launch_slurm_on_the_seed(capsys, tmp_path):
    script = ok(capsys, "launch", "--cluster", SEED, "--config", "llm_7b", "--dry-run")   # scheduler.default: slurm
    opts = dict(ln[len("#SBATCH --"):].split("=", 1) for ln in script.splitlines()
                if ln.startswith("#SBATCH --") and "=" in ln)
    assert opts["partition"] == "gpu" and opts["gpus-per-node"] == "4" and opts["cpus-per-task"] == "64"
    assert opts["output"].startswith("/storage/logs/")                 # storage.root
    assert "NCCL_IB_DISABLE=0" in script                                # ib-ndr -> the infiniband preset
    # the job config and the flags override the cluster
    script = ok(capsys, "launch", "--cluster", SEED, "--config", "llm_7b", "--dry-run", "--partition", "debug",
                "--set", "job.gpus_per_node=2", "--root", tmp_path)
    assert "#SBATCH --partition=debug" in script and "#SBATCH --gpus-per-node=2" in script
    assert_one_line_error(run_cli("launch", "--cluster", SEED, "--nodes", "9", "--dry-run"),
                          "job.nodes (9) is more than the 8 node(s) of cluster 'seed'", str(SEED))


def test_too_many_nodes_reads_well_for_a_cluster_named_cluster(capsys, tmp_path):
    """Issue 34: "is more than cluster cluster has (1)" read as a stutter; the name is quoted, its file named."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text(SEED.read_text().replace("name: seed", "name: cluster"))
    proc = cli_inprocess(capsys, "launch", "--cluster", spec, "--config", "llm_7b", "--nodes", "9", "--dry-run")
    assert_one_line_error(proc, "the 8 node(s) of cluster 'cluster'", str(spec))


@pytest.mark.parametrize("kind", ["indexed-job", "volcano", "jobset", "pytorchjob"])
def test_launch_every_kubernetes_form_on_the_seed(capsys, kind):
    docs = list(yaml.safe_load_all(ok(capsys, "launch", "--cluster", SEED, "--config", "llm_7b", "--scheduler", "k8s",
                                      "--k8s-kind", kind, "--dry-run")))
    assert {d["metadata"]["namespace"] for d in docs} == {"llm"}
    text = yaml.safe_dump_all(docs)
    assert f"image: {IMAGE}" in text and "nvidia.com/gpu: '4'" in text
    job = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.yaml"])["job"]
    assert job["k8s"]["claims"] == {"datasets": {"claim": "datasets-pvc", "read_only": True},
                                    "checkpoints": {"claim": "checkpoints-pvc", "read_only": False}}
    assert job["k8s"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_monitor_config_on_the_seed(capsys):
    cfg = yaml.safe_load(ok(capsys, "monitor", "config", "--cluster", SEED))
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    assert jobs["llmcluster-node"] == [f"{h}:9400" for h in HOSTS]
    assert jobs["llmcluster-train"] == [f"{h}:{9401 + r}" for h in HOSTS for r in range(4)]   # a port per GPU
    docs = list(yaml.safe_load_all(ok(capsys, "monitor", "config", "--cluster", SEED, "--kubernetes")))
    pod = docs[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == IMAGE and pod["containers"][0]["args"][-2:] == ["--expected-gpus", "4"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}


def test_every_command_finds_the_cluster_by_env_and_cwd(tmp_path):
    env_cfg = yaml.safe_load(run_cli("monitor", "config", env={**__import__("conftest").cli_env(),
                                                               "LLMCLUSTER_CLUSTER": "seed-a100"}, check=True).stdout)
    assert env_cfg["scrape_configs"][0]["static_configs"][0]["targets"][0] == "gpu01:9400"
    (tmp_path / "cluster.yaml").write_text(SEED.read_text())
    script = run_cli("launch", "--config", "llm_7b", "--dry-run", cwd=tmp_path, check=True).stdout
    assert "#SBATCH --partition=gpu" in script
