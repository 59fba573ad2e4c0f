"""`launch --scheduler skypilot`: the job rendered as a SkyPilot task, refused by our own checks before sky is asked,
and (slow, with `make sky`'s venv) every shipped spec x job config accepted by SkyPilot's own task parser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import assert_one_line_error, cli_env, run_cli

REPO = Path(__file__).resolve().parents[1]
CLOUD_SPECS = ("lambda-a100", "k8s-cloud-h100")
JOB_CONFIGS = {"llm_tiny": [], "llm_7b": ["--nodes", "2"]}    # the 7B job is 8 nodes; the cloud specs have 2


def dry_run(tmp_path: Path, cluster: str, config: str = "llm_tiny", *extra: str, env=None):
    return run_cli("launch", "-c", REPO / "configs" / f"{config}.yaml", "--cluster", cluster, "--scheduler", "skypilot",
                   "--dry-run", "--root", tmp_path / "storage", *extra, cwd=tmp_path, env=env)


def task_of(tmp_path: Path, cluster: str, config: str = "llm_tiny", *extra: str, env=None) -> tuple[str, dict]:
    p = dry_run(tmp_path, cluster, config, *extra, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout, yaml.safe_load(p.stdout)


def cluster_file(tmp_path: Path, base: str, **cloud) -> Path:
    data = yaml.safe_load((REPO / "clusters" / f"{base}.yaml").read_text())
    data["cloud"].update(cloud)
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def test_lambda_task(tmp_path):
    env = cli_env(WANDB_API_KEY="wandb-value-never-rendered", HF_TOKEN="hf-value-never-rendered")
    text, task = task_of(tmp_path, "lambda-a100", "llm_tiny", "--nodes", "2",
                         "--set", "job.secret_env=[WANDB_API_KEY,HF_TOKEN]", env=env)
    assert task["num_nodes"] == 2
    res = task["resources"]
    assert res["infra"] == "lambda" and res["accelerators"] == {"A100-80GB": 8, "A100": 8}
    assert "use_spot" not in res and "job_recovery" not in res      # Lambda: no spot, no recovery asked
    assert task["secrets"] == {"WANDB_API_KEY": None, "HF_TOKEN": None}
    assert "never-rendered" not in text
    assert task["workdir"] == str(REPO) and "pip install" in task["setup"]
    run = task["run"]
    for var in ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE"):
        assert f"${var}" in run
    assert 'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)' in run
    assert "storage pull llm-tiny --from /mnt/llmcluster-bucket" in run      # the bucket copy, before training
    config = str(tmp_path / "storage" / "logs" / "llm-tiny" / "launches" / "1" / "config.yaml")
    assert task["file_mounts"] == {config: config}


def test_kubernetes_cloud_task_is_a_managed_job_recovering_the_preemption_exit(tmp_path):
    from llmcluster.errors import EXIT_PREEMPTED

    _, task = task_of(tmp_path, "k8s-cloud-h100")
    res = task["resources"]
    assert res["infra"] == "kubernetes" and res["accelerators"] == {"H100": 8}
    assert res["job_recovery"]["recover_on_exit_codes"] == [EXIT_PREEMPTED]
    assert res["job_recovery"]["max_restarts_on_errors"] == 1


def test_spot_where_the_cloud_sells_it(tmp_path):
    _, task = task_of(tmp_path, str(cluster_file(tmp_path, "lambda-a100", provider="aws", use_spot=True)))
    assert task["resources"]["use_spot"] is True and task["resources"]["infra"] == "aws"
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [75]


@pytest.mark.parametrize("cloud, needle", [
    ({"provder": "lambda"}, "provder"),                                   # a bad field
    ({"accelerators": {"A1000": 8}}, "unknown GPU 'A1000'"),              # a GPU the table lacks
    ({"accelerators": {"H100-PCIe": 8}}, "no SkyPilot catalog name"),     # in the table, not in SkyPilot's catalog
    ({"use_spot": True}, "lambda has no spot"),                           # spot where the cloud sells none
    ({"provider": "moon"}, "provider"),
])
def test_refused_in_one_line_before_sky(tmp_path, cloud, needle):
    # no sky anywhere: a refusal must come from our own checks
    env = cli_env(PATH="/usr/bin:/bin", LLMCLUSTER_SKY=str(tmp_path / "no-sky"))
    assert_one_line_error(dry_run(tmp_path, str(cluster_file(tmp_path, "lambda-a100", **cloud)), env=env), needle)


def test_ft_and_cloudless_specs_refused(tmp_path):
    assert_one_line_error(dry_run(tmp_path, "lambda-a100", "llm_tiny", "--set", "ft.enabled=true"),
                          "ft.enabled is not supported on --scheduler skypilot")
    assert_one_line_error(dry_run(tmp_path, "seed-a100", "llm_tiny"), "needs a cluster spec with a cloud: section")


# -- SkyPilot's own parser, in its own venv (never imported here) --------------------------------------------------
VALIDATE = """
import json, sys, sky
for name, task in json.load(sys.stdin):
    try:
        nodes, names = task["num_nodes"], sorted(task.get("secrets") or {})
        # as written: names only, which SkyPilot reads as references with no value in the text
        t = sky.Task.from_yaml_config(json.loads(json.dumps(task)))   # (it takes keys out of what it reads)
        assert t.num_nodes == nodes, name
        assert sorted(r.name for r in t.managed_secret_refs) == names, name
        # as `sky launch --secret NAME` submits it: the value from the launching shell
        t = sky.Task.from_yaml_config(task, secrets_overrides=[(n, "value-" + n) for n in names])
        print(json.dumps([name, "ok", sorted(t.secrets or {})]))
    except Exception as e:
        print(json.dumps([name, f"{type(e).__name__}: {e}", []]))
"""


def sky_python() -> Path | None:
    cache = Path.home() / ".cache" / "llmcluster"
    built = sorted((p for p in cache.glob("sky-*") if (p / ".installed").is_file()),
                   key=lambda p: (p / ".installed").stat().st_mtime)   # the newest build, as sky_program()
    return built[-1] / "bin" / "python" if built else None


@pytest.mark.slow
def test_every_rendered_task_passes_skypilots_parser(tmp_path):
    python = sky_python()
    if python is None:
        pytest.skip("no SkyPilot venv (make sky)")
    tasks = []
    for cluster in CLOUD_SPECS:
        for config, flags in JOB_CONFIGS.items():
            out = tmp_path / f"{cluster}-{config}"
            out.mkdir()
            _, task = task_of(out, cluster, config, *flags, "--set", "job.secret_env=[WANDB_API_KEY,HF_TOKEN]")
            for local in task["file_mounts"].values():    # SkyPilot checks a mount's local source exists
                Path(local).parent.mkdir(parents=True)
                Path(local).write_text("run: {}\n")
            tasks.append([f"{cluster} x {config}", task])
    p = subprocess.run([str(python), "-c", VALIDATE], input=json.dumps(tasks), capture_output=True, text=True, check=False,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    results = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r[0] for r in results] == [t[0] for t in tasks]
    for name, verdict, secrets in results:
        assert verdict == "ok", (name, verdict)
        assert secrets == ["HF_TOKEN", "WANDB_API_KEY"], (name, secrets)


@pytest.mark.slow
def test_skypilots_parser_catches_a_misspelt_field():
    """The parser test above is no rubber stamp: the same call refuses a field SkyPilot does not know."""
    python = sky_python()
    if python is None:
        pytest.skip("no SkyPilot venv (make sky)")
    bad = [["bad", {"num_node": 2, "run": "true"}]]
    p = subprocess.run([str(python), "-c", VALIDATE], input=json.dumps(bad), capture_output=True, text=True, check=False,
                       timeout=300)
    assert "num_node" in json.loads(p.stdout.splitlines()[0])[1]


# -- launch and jobs status|logs|cancel against a stand-in `sky` on PATH that records its arguments ------------------
STAND_IN = """#!/bin/bash
printf '%s\\n' "$*" >> "$SKY_ARGS"
case "$1" in
  jobs) case "$2" in
          queue) printf 'Fetching managed job statuses...\\nID  TASK  NAME  REQUESTED  SUBMITTED  TOT. DURATION  STATUS\\n'
                 printf '4  -  other-run  2x[H100:8]  2 mins ago  2m  RUNNING\\n'
                 printf '3  -  llm-tiny  2x[H100:8]  1 hr ago  1h  RECOVERING\\n' ;;
          logs) echo "step 10 | loss 5.1" ;;
        esac ;;
  queue) printf 'Job queue of cluster %s\\nID  NAME  SUBMITTED  STARTED  DURATION  RESOURCES  STATUS  LOG\\n' "$2"
         printf '1  llm-tiny  5 mins ago  5 mins ago  5m  2x[A100:8]  RUNNING  ~/sky_logs/1\\n' ;;
  logs) echo "step 20 | loss 4.2" ;;
esac
exit 0
"""


def stand_in_sky(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sky").write_text(STAND_IN)
    (bin_dir / "sky").chmod(0o755)
    return cli_env(PATH=f"{bin_dir}:/usr/bin:/bin", SKY_ARGS=str(tmp_path / "sky-args"), WANDB_API_KEY="x")


def sky_calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "sky-args").read_text().splitlines()


@pytest.mark.parametrize("cluster, managed", [("lambda-a100", False), ("k8s-cloud-h100", True)])
def test_jobs_status_logs_cancel_through_sky(tmp_path, cluster, managed):
    env = stand_in_sky(tmp_path)
    root = tmp_path / "storage"
    p = run_cli("launch", "-c", REPO / "configs" / "llm_tiny.yaml", "--cluster", cluster, "--scheduler", "skypilot",
                "--root", root, "--set", "job.secret_env=[WANDB_API_KEY]", cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr
    task = root / "logs" / "llm-tiny" / "launches" / "1" / "task.yaml"
    launched = sky_calls(tmp_path)[-1]
    assert launched == (f"jobs launch -y -n llm-tiny --secret WANDB_API_KEY {task}" if managed else
                        f"launch -y -c llm-tiny --secret WANDB_API_KEY {task}")
    assert yaml.safe_load(task.read_text().split("\n", 1)[1])["num_nodes"] == 1

    status = run_cli("jobs", "status", "llm-tiny", "--root", root, "--json", env=env, check=True)
    info = json.loads(status.stdout)
    assert info["scheduler"] == "skypilot"
    assert (info["state"], info["detail"]) == (("PENDING", "sky: RECOVERING") if managed else ("RUNNING", "sky: RUNNING"))
    assert sky_calls(tmp_path)[-1] == ("jobs queue" if managed else "queue llm-tiny")

    logs = run_cli("jobs", "logs", "llm-tiny", "--root", root, env=env, check=True)
    assert "loss" in logs.stdout
    assert sky_calls(tmp_path)[-1] == ("jobs logs -n llm-tiny --no-follow" if managed else "logs llm-tiny --no-follow")

    # a second launch while sky says the job is active is refused, as on every scheduler
    again = run_cli("launch", "-c", REPO / "configs" / "llm_tiny.yaml", "--cluster", cluster, "--scheduler",
                    "skypilot", "--root", root, "--set", "job.secret_env=[WANDB_API_KEY]", cwd=tmp_path, env=env)
    assert_one_line_error(again, "already")

    run_cli("jobs", "cancel", "llm-tiny", "--root", root, env=env, check=True)
    assert sky_calls(tmp_path)[-2:] == (["jobs queue", "jobs cancel -y -n llm-tiny"] if managed else
                                        ["cancel -y --all llm-tiny", "down -y llm-tiny"])


def test_launch_refuses_a_missing_secret_before_sky(tmp_path):
    env = stand_in_sky(tmp_path)
    env.pop("WANDB_API_KEY")
    p = run_cli("launch", "-c", REPO / "configs" / "llm_tiny.yaml", "--cluster", "lambda-a100", "--scheduler",
                "skypilot", "--root", tmp_path / "storage", "--set", "job.secret_env=[WANDB_API_KEY]", cwd=tmp_path,
                env=env)
    assert_one_line_error(p, "WANDB_API_KEY not set")
    assert not (tmp_path / "sky-args").exists()


# -- SkyPilot's optimizer, offline, on catalog fixtures (tests/data/skypilot_catalog/SOURCE.md) ---------------------
# In process rather than `sky launch --dryrun` (which starts SkyPilot's API server and wants rsync): SkyPilot's state
# as `sky check` leaves it with Lambda credentials, then the optimizer on the task. The Kubernetes-cloud spec is
# checked by schema only: its optimizer asks the live cluster.
OPTIMIZE = """
import json, sys
import sky
from sky import check, global_user_state, optimizer
from sky.clouds import cloud
from sky.utils import dag_utils
global_user_state.set_allowed_clouds(check._get_workspace_allowed_clouds("default"), "default")
global_user_state.set_enabled_clouds(["Lambda"], cloud.CloudCapability.COMPUTE, "default")
dag = dag_utils.convert_entrypoint_to_dag(sky.Task.from_yaml_config(json.load(sys.stdin)))
try:
    optimizer.Optimizer.optimize(dag, quiet=True)
except Exception as e:
    print(json.dumps([type(e).__name__]))
else:
    best = dag.tasks[0].best_resources
    print(json.dumps([str(best.cloud), best.instance_type, best.accelerators]))
"""


def optimize(python: Path, home: Path, task: dict) -> list:
    p = subprocess.run([str(python), "-c", OPTIMIZE], input=json.dumps(task), capture_output=True, text=True,
                       timeout=300, check=False, env={**os.environ, "HOME": str(home)}, cwd=home)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_skypilots_optimizer_picks_the_expected_lambda_instance_offline(tmp_path):
    python = sky_python()
    if python is None:
        pytest.skip("no SkyPilot venv (make sky)")
    home = tmp_path / "home"
    shutil.copytree(REPO / "tests" / "data" / "skypilot_catalog", home / ".sky" / "catalogs" / "v8",
                    ignore=shutil.ignore_patterns("*.md"))
    _, task = task_of(tmp_path, "lambda-a100", "llm_7b", "--nodes", "2")
    for local in task["file_mounts"].values():
        Path(local).parent.mkdir(parents=True)
        Path(local).write_text("run: {}\n")
    # the shipped spec's candidates, {A100-80GB: 8, A100: 8}: the cheaper of the two (placeholder prices)
    assert optimize(python, home, task) == ["Lambda", "gpu_8x_a100", {"A100": 8}]
    only_80gb = {**task, "resources": {**task["resources"], "accelerators": {"A100-80GB": 8}}}
    assert optimize(python, home, only_80gb) == ["Lambda", "gpu_8x_a100_80gb_sxm4", {"A100-80GB": 8}]
    # what our own checks refuse earlier, SkyPilot's optimizer refuses too (no such GPU; no spot on Lambda)
    for bad in ({"accelerators": {"A1000": 4}}, {"use_spot": True}):
        wrong = {**task, "resources": {**task["resources"], **bad}}
        assert optimize(python, home, wrong) == ["ResourcesUnavailableError"], bad


def test_provision_refuses_a_cloud_spec(tmp_path):
    """Ansible has no machines of ours to set up on a rented cloud: SkyPilot starts them per run."""
    assert_one_line_error(run_cli("provision", "--cluster", "lambda-a100", "--out", tmp_path / "out", cwd=tmp_path),
                          "nothing to provision")
    assert not (tmp_path / "out").exists()
