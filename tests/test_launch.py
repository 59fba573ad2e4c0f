"""launch: the job spec, the sbatch renderer (offline), hostile input, and a real local torchrun launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import assert_one_line_error, run_cli

HOSTILE = ["x; rm -rf /tmp/pwned", "it's", 'a"b', "$(touch /tmp/pwned)", "`id`", "a\nb"]


def dry(root: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli("launch", "--scheduler", "slurm", "--root", root, "--dry-run", *args)


def sbatch_lines(script: str) -> dict[str, str]:
    return dict(ln[len("#SBATCH --"):].split("=", 1) for ln in script.splitlines() if ln.startswith("#SBATCH --")
                and "=" in ln)


def test_sbatch_like_the_seed_and_valid_bash(tmp_path):
    p = dry(tmp_path / "s", "--nodes", "8", "--gpus-per-node", "4", "--time", "72:00:00", "--partition", "gpu",
            "--set", "job.cpus_per_node=64", "--set", "job.mem_per_node=480G")
    assert p.returncode == 0, p.stderr
    script = p.stdout
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    opts = sbatch_lines(script)
    assert opts["nodes"] == "8" and opts["ntasks-per-node"] == "1" and opts["gpus-per-node"] == "4"
    assert opts["time"] == "72:00:00" and opts["partition"] == "gpu" and opts["mem"] == "480G"
    assert opts["output"] == f"{tmp_path}/s/logs/llm-tiny/slurm-%j.out"
    assert opts["signal"] == "B:USR2@300" and "#SBATCH --requeue" in script
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")][0]
    assert "--kill-on-bad-exit=1" in srun and '--rdzv-endpoint "$head:$rdzv_port"' in srun
    assert '--rdzv-id "$SLURM_JOB_ID"' in srun and "--nproc-per-node 4" in srun and "--nnodes 8" in srun
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "export NCCL_DEBUG=WARN" in script and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    assert '[ "${SLURM_RESTART_COUNT:-0}" -lt 3 ]' in script
    assert not (tmp_path / "s").exists(), "--dry-run wrote files"


def test_env_values_written_as_numbers_are_exported_as_text(tmp_path):
    # `--set job.env.X=22` and `env: {X: 22}` in YAML both parse as numbers; the environment is text
    p = dry(tmp_path, "--set", "job.env.NCCL_IB_TIMEOUT=22", "--set", "job.env.NCCL_IB_DISABLE=true")
    assert p.returncode == 0, p.stderr
    assert "export NCCL_IB_TIMEOUT=22" in p.stdout and "export NCCL_IB_DISABLE=true" in p.stdout


def test_pyxis_container_flags(tmp_path):
    p = dry(tmp_path, "--image", "nvcr.io/nvidia/pytorch:24.07-py3",
            "--set", "job.mounts=[{source: /data, path: /data, read_only: true}]")
    assert p.returncode == 0, p.stderr
    srun = [ln for ln in p.stdout.splitlines() if ln.startswith("srun ")][0]
    assert "--container-image=nvcr.io/nvidia/pytorch:24.07-py3" in srun
    assert f"--container-mounts={tmp_path}:{tmp_path},/data:/data:ro" in srun
    assert " python -m torch.distributed.run" in srun     # the container's python, not ours


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_names_are_refused(tmp_path, bad):
    from llmcluster.config.load import load_job_config
    from llmcluster.errors import UserError

    # every value that lands in an #SBATCH line or a Kubernetes name: refused by the config itself
    for key in ("run.name", "job.partition", "job.account", "job.image", "job.time", "job.mem_per_node",
                "job.k8s.namespace", "job.k8s.storage_claim"):
        with pytest.raises(UserError):
            load_job_config(None, [f"{key}={bad}"])
    # and through the CLI: one line, exit 2, nothing run
    assert_one_line_error(dry(tmp_path, "--partition", bad), "partition")
    assert not Path("/tmp/pwned").exists()


@pytest.mark.parametrize("bad", HOSTILE[:-1])
def test_hostile_words_in_commands_and_paths_are_quoted(tmp_path, bad):
    """Arguments and env values reach the script quoted: bash parses them back to exactly what was given."""
    root = tmp_path / "root dir"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"job": {"env": {"X": bad}}}))
    p = run_cli("launch", "--config", cfg, "--scheduler", "local", "--root", root, "--dry-run",
                "--", "printf", "%s\\n", bad)
    assert p.returncode == 0, p.stderr
    script = p.stdout.replace("exec ", "exec printf '%s\\n' ")          # print the argv instead of running it
    out = subprocess.run(["bash", "-c", script.split("\n", 1)[1] + '\nprintf "%s\\n" "$X"'], text=True,
                         capture_output=True).stdout
    assert bad in out.splitlines() and str(root / "logs" / "llm-tiny" / "ranks") in out.splitlines()
    assert not Path("/tmp/pwned").exists()
    # and the sbatch script refuses the path (it cannot be quoted in #SBATCH lines) but quotes the command
    p = dry(root, "--", "echo", bad)
    assert_one_line_error(p, "#SBATCH")
    p = dry(tmp_path / "s", "--config", str(cfg), "--", "echo", bad)
    assert p.returncode == 0
    subprocess.run(["bash", "-n"], input=p.stdout, text=True, check=True)


def test_newline_in_a_command_word_is_refused(tmp_path):
    assert_one_line_error(dry(tmp_path, "--", "echo", "a\nb"), "newline")


@pytest.mark.parametrize("args,needle", [
    (["--nodes", "0"], "job.nodes"),
    (["--scheduler-typo"], "unrecognized"),
    (["--set", "job.gpus_per_nod=4"], "did you mean 'job.gpus_per_node'"),
    (["--gpus-per-node", "2", "--procs-per-node", "4"], "procs_per_node"),
    (["--time", "00:01:00"], "signal_before_s"),
    (["--set", "job.nccl=fast"], "job.nccl"),
    (["--apply"], "--apply"),
])
def test_bad_input_is_one_line(tmp_path, args, needle):
    assert_one_line_error(dry(tmp_path, *args), needle)


def test_local_needs_one_node(tmp_path):
    p = run_cli("launch", "--scheduler", "local", "--nodes", "2", "--root", tmp_path, "--dry-run")
    assert_one_line_error(p, "--scheduler slurm")


def test_local_launch_runs_torchrun_with_per_rank_logs(tmp_path):
    """A real `torchrun --standalone` with 2 ranks running a generic program; then jobs status/logs."""
    root = tmp_path / "s"
    p = run_cli("launch", "--scheduler", "local", "--procs-per-node", "2", "--root", root, "--set",
                "run.name=loc", "--", "bash", "-c", 'echo "rank $RANK of $WORLD_SIZE"')
    assert p.returncode == 0, p.stderr
    logs = root / "logs" / "loc"
    rec = json.loads((logs / "job.json").read_text())
    assert rec["state"] == "COMPLETED" and rec["exit_code"] == 0 and rec["world_size"] == 2
    assert (logs / "launch.sh").read_text().startswith("#!/bin/bash") and (logs / "config.yaml").is_file()
    per_rank = sorted(logs.glob("ranks/*/attempt_0/*/stdout.log"))
    assert [f.read_text().strip() for f in per_rank] == ["rank 0 of 2", "rank 1 of 2"]
    st = json.loads(run_cli("jobs", "status", "loc", "--root", root, "--json", check=True).stdout)
    assert st["state"] == "COMPLETED" and st["exit_code"] == 0
    out = run_cli("jobs", "logs", "loc", "--root", root, check=True).stdout
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    # a failing program is recorded as failed with its exit code
    p = run_cli("launch", "--scheduler", "local", "--root", root, "--set", "run.name=loc", "--", "false")
    assert p.returncode != 0
    rec = json.loads((logs / "job.json").read_text())
    assert rec["state"] == "FAILED" and rec["previous_job_ids"]


def test_jobs_on_unknown_run_is_one_line(tmp_path):
    assert_one_line_error(run_cli("jobs", "status", "nope", "--root", tmp_path), "nope")
    assert_one_line_error(run_cli("jobs", "logs", "../etc", "--root", tmp_path), "invalid run name")


def test_launch_never_imports_torch():
    code = ("import sys, llmcluster.launch.launcher, llmcluster.launch.slurm, llmcluster.launch.k8s, "
            "llmcluster.launch.local, llmcluster.launch.jobs, llmcluster.cli.launch, llmcluster.cli.jobs; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
