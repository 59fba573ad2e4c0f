"""The suite states its own world (issue 33): a clone where a user followed the README (`cluster init` wrote a
one-node ./cluster.yaml, `make demo` made ./storage) and a shell with LLMCLUSTER_* set must not change a test's
outcome. Before conftest's _own_world, 21 launch, Kubernetes, monitor and plan-fit tests failed in such a clone
("job.nodes (8) is more than cluster cluster has (1)")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, cli_env

# one per kind that failed, each fast: they read the default cluster (launch, k8s, monitor config, plan fit) or
# the default storage root
REPRESENTATIVE = [
    "tests/test_launch.py::test_sbatch_like_the_seed_and_valid_bash",
    "tests/test_launch_k8s.py::test_indexed_job_is_the_seed_form",
    "tests/test_monitor.py::test_config_static_nodes_slurm_nodelist_and_cluster_spec",
    "tests/test_plan_fit.py::test_launch_refuses_in_one_line_unless_forced",
    "tests/test_storage.py::test_root_from_env_then_config",
    "tests/test_suite_isolation.py::test_a_test_starts_in_a_directory_and_environment_of_its_own",
]

ONE_NODE = "name: newcomer\nnodes: {count: 1}\nhardware: {gpu: none, gpus_per_node: 0}\n"


def test_a_test_starts_in_a_directory_and_environment_of_its_own():
    cwd = Path.cwd()
    assert cwd != REPO and not (cwd / "cluster.yaml").exists() and not (cwd / "storage").exists()
    assert (cwd / "configs" / "llm_tiny.yaml").is_file()          # the README's relative paths resolve
    from conftest import MACHINE_ENV   # the machine's engines, caches and thread cap: the one list

    assert not [k for k in os.environ if k.startswith("LLMCLUSTER_") and k not in MACHINE_ENV]


def test_tests_pass_in_a_clone_with_a_users_cluster_storage_and_environment(tmp_path):
    from test_readme import fresh_clone

    clone = fresh_clone(tmp_path / "clone")
    (clone / "cluster.yaml").write_text(ONE_NODE)
    (clone / "elsewhere.yaml").write_text(ONE_NODE.replace("newcomer", "elsewhere"))
    for area in ("checkpoints", "logs", "datasets"):
        (clone / "storage" / area).mkdir(parents=True)
    env = cli_env(PYTHONPATH=str(clone), LLMCLUSTER_CLUSTER=str(clone / "elsewhere.yaml"),
                  LLMCLUSTER_STORAGE=str(clone / "storage"), LLMCLUSTER_TESTING="1",
                  LLMCLUSTER_INJECT_NAN_AT_STEP="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *REPRESENTATIVE], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-2000:]
    assert f"{len(REPRESENTATIVE)} passed" in p.stdout, p.stdout[-2000:]
    assert sorted(q.name for q in (clone / "storage").iterdir()) == ["checkpoints", "datasets", "logs"]
