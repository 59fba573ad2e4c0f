"""launch: the job spec, the sbatch renderer (offline), hostile input, and a real local torchrun launch."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, assert_one_line_error, cli_env, run_cli

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
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert "--max-restarts 3" in srun and "umask 027" in script
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script   # a fresh store per restart round
    assert "export NCCL_DEBUG=WARN" in script and "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in script  # GPU job: the allocator preset
    # and NCCL's flight recorder, dumping into the run's logs when the watchdog finds a hung collective
    for name, value in (("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"), ("TORCH_FR_BUFFER_SIZE", "2000"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                        ("TORCH_FR_DUMP_TEMP_FILE", f"{tmp_path}/s/logs/llm-tiny/flight_recorder/rank_"),
                        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{tmp_path}/s/logs/llm-tiny/flight_recorder/rank_")):
        assert f"export {name}={value}" in script, name
    assert '[ "${SLURM_RESTART_COUNT:-0}" -lt 3 ]' in script
    assert not (tmp_path / "s").exists(), "--dry-run wrote files"


FAKE_SLURM = {
    # the CLIs the batch script calls, as a Slurm whose node names resolve nowhere would answer them
    "scontrol": """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'gpu-a\\ngpu-b\\n' ;;
  "show node") echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=$4 State=ALLOCATED" ;;
  "requeue "*) echo "requeue $2" >> "$FAKE_LOG" ;;
esac
""",
    # srun: record the argv; the "ranks" write their exit reason, and the step ends with $FAKE_RC
    "srun": """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_LOG.argv"
[ -n "${FAKE_REASON:-}" ] && echo "$FAKE_REASON" > "$LLMCLUSTER_EXIT_DIR/exit-rank0"
exit "${FAKE_RC:-0}"
"""}


# The stand-in job's id, which picks its ports (rendezvous 29500 + id, Lighthouse 29510 + id, each the first free
# one on): far above the real test cluster's ids (test_launch_slurm.py and the others run beside these in make
# test's Slurm stream; once seen: job 7 here and there, both Lighthouses on 29517), and 100 apart per xdist worker.
FAKE_JOB = 907 - 100 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


CONFIG_CHECK = re.compile(r"config_sha256=([0-9a-f]{64})\n.*sha256sum < (\S+) ")


def stand_in_config(script: str) -> str:
    """A --dry-run script names a config.yaml no launch wrote, and checks its sha256 before training
    (test_a_swapped_launch_config_is_refused_before_training): a stand-in config is written there and the
    script's sha256 made its."""
    m = CONFIG_CHECK.search(script)
    if not m or Path(m[2]).exists():
        return script
    Path(m[2]).parent.mkdir(parents=True, exist_ok=True)
    Path(m[2]).write_text("# stand-in for the launch's config\n")
    return script.replace(m[1], hashlib.sha256(b"# stand-in for the launch's config\n").hexdigest())


def run_batch_script(tmp_path: Path, script: str, fakes: dict | None = None, **env: str) -> tuple[str, str]:
    """The sbatch script run by bash as slurmd would (job id FAKE_JOB), with scontrol/srun stand-ins on PATH
    (the real ones are exercised in test_launch_slurm.py; `fakes` replaces some); returns (stdout, the
    stand-ins' log)."""
    import errno
    import os
    import socket

    script = stand_in_config(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {**FAKE_SLURM, **(fakes or {})}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "fake.log"
    log.write_text("")
    with socket.socket() as busy:          # the job's first-choice port is taken: the next one is used
        try:
            busy.bind(("", 29500 + FAKE_JOB))
            busy.listen()
        except OSError as e:               # another process on this machine holds it: taken all the same
            assert e.errno == errno.EADDRINUSE, e
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": str(FAKE_JOB),
                                "SLURM_JOB_NODELIST": "gpu-[a-b]", "FAKE_LOG": str(log), **env})
    return p.stdout + p.stderr, log.read_text()


def test_rendezvous_at_the_head_nodes_nodeaddr_on_a_free_port(tmp_path):
    script = dry(tmp_path / "s", "--nodes", "2").stdout
    out, _ = run_batch_script(tmp_path, script)
    assert f"rendezvous 10.1.2.3:{29501 + FAKE_JOB} (node gpu-a)" in out, out
    argv = (tmp_path / "fake.log.argv").read_text().splitlines()
    assert argv[argv.index("--rdzv-endpoint") + 1] == f"10.1.2.3:{29501 + FAKE_JOB}"
    assert argv[argv.index("--max-restarts") + 1] == "3"


@pytest.mark.parametrize("rc,reason,requeued", [
    (0, "completed", False),
    (1, "failed DistBackendError: NCCL timeout", True),    # a runtime failure torchrun could not cure
    (1, "", True),                                          # a rank killed outright writes nothing
    (1, "fatal BadStepLimit: 5 non-finite steps", False),  # a restart would repeat it
    (1, "preempted", True),
])
def test_requeue_on_runtime_failure_not_on_a_fatal_one(tmp_path, rc, reason, requeued):
    script = dry(tmp_path / "s", "--nodes", "2", "--max-requeues", "2").stdout
    out, log = run_batch_script(tmp_path, script, FAKE_RC=str(rc), FAKE_REASON=reason)
    assert (f"requeue {FAKE_JOB}" in log) == requeued, out
    if reason.startswith("fatal"):
        assert "not requeueing: fatal BadStepLimit" in out
    if requeued:
        assert f"requeueing job {FAKE_JOB} (restart 0 of 2)" in out
    out, log = run_batch_script(tmp_path, script, FAKE_RC=str(rc), FAKE_REASON=reason, SLURM_RESTART_COUNT="2")
    assert f"requeue {FAKE_JOB}" not in log, "job.max_requeues used up"


def test_env_values_written_as_numbers_are_exported_as_text(tmp_path):
    # `--set job.env.X=22` and `env: {X: 22}` in YAML both parse as numbers; the environment is text
    p = dry(tmp_path, "--set", "job.env.NCCL_IB_TIMEOUT=22", "--set", "job.env.NCCL_IB_DISABLE=true")
    assert p.returncode == 0, p.stderr
    assert "export NCCL_IB_TIMEOUT=22" in p.stdout and "export NCCL_IB_DISABLE=true" in p.stdout


@pytest.mark.parametrize("key", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "ldap_passwd",
                                 "SECRET", "Api_Key_2"])
def test_env_keys_that_look_secret_are_refused_with_a_pointer_to_secret_env(tmp_path, key):
    # job.env is written in clear into job.sbatch / launch.sh / job.yaml: a token belongs in job.secret_env
    p = dry(tmp_path, "--set", f"job.env.{key}=hunter2")
    assert_one_line_error(p, f"job.env.{key}", "job.secret_env")
    assert "hunter2" not in p.stdout + p.stderr


def test_env_keys_with_secret_words_inside_other_words_pass(tmp_path):
    p = dry(tmp_path, "--set", "job.env.TOKENIZERS_PARALLELISM=false", "--set", "job.env.NCCL_IB_PKEY=1",
            "--set", "job.env.KEYRING_BACKEND=x", "--set", "job.secret_env=[HF_TOKEN]")
    assert p.returncode == 0, p.stderr
    assert "export TOKENIZERS_PARALLELISM=false" in p.stdout and "export NCCL_IB_PKEY=1" in p.stdout


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
    first = logs / "launches" / "1"
    assert (first / "launch.sh").read_text().startswith("#!/bin/bash") and (first / "config.yaml").is_file()
    assert rec["artifact"] == str(first / "launch.sh")
    # a shared cluster's other users read nothing of the run; what a launch wrote is read-only
    assert (logs.stat().st_mode & 0o777) == 0o750 and (first.stat().st_mode & 0o777) == 0o750
    assert (first / "config.yaml").stat().st_mode & 0o777 == 0o440
    assert (first / "launch.sh").stat().st_mode & 0o777 == 0o400     # the submitter's alone
    assert all(f.stat().st_mode & 0o027 == 0 for f in logs.rglob("*")), "group-writable or world-readable"
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
    assert rec["state"] == "FAILED" and rec["previous_job_ids"] and rec["launch"] == 2
    assert (first / "config.yaml").is_file() and (logs / "launches" / "2" / "launch.sh").is_file()


def test_second_launch_of_an_active_run_is_refused_unless_forced(tmp_path):
    root = tmp_path / "s"
    args = ["launch", "--scheduler", "local", "--root", root, "--set", "run.name=busy"]
    running = subprocess.Popen([sys.executable, "-m", "llmcluster", *map(str, args), "--", "sleep", "600"],
                               env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the first launch RUNNING before the second starts (it took over 20 s on a loaded AVX2 machine, and the
        # second, started early, found nothing to refuse): the wait is a hang guard, not a timing
        rec_file = root / "logs" / "busy" / "job.json"
        deadline = time.monotonic() + 300
        while not (rec_file.is_file() and json.loads(rec_file.read_text()).get("state") == "RUNNING"):
            assert running.poll() is None and time.monotonic() < deadline, "the first launch never ran"
            time.sleep(0.1)
        assert_one_line_error(run_cli(*args, "--", "true"), "already RUNNING")
        assert run_cli(*args, "--force", "--", "true").returncode == 0
        # job.json now names the forced launch; the first one still runs and is cancelled by its own pid
    finally:
        running.terminate()
        running.wait(timeout=60)


def test_cancel_does_not_trust_the_pid_in_job_json(tmp_path):
    """A doctored job.json naming some other process: `jobs cancel` refuses to signal it."""
    root = tmp_path / "s"
    other = subprocess.Popen(["sleep", "60"])
    try:
        logs = root / "logs" / "fake"
        logs.mkdir(parents=True)
        (logs / "job.json").write_text(json.dumps({"run": "fake", "scheduler": "local", "job_id": "local-1",
                                                    "pid": other.pid, "state": "RUNNING"}))
        assert_one_line_error(run_cli("jobs", "cancel", "fake", "--root", root), "not running")
        assert other.poll() is None, "the other process was signalled"
    finally:
        other.kill()
        other.wait()


def test_jobs_on_unknown_run_is_one_line(tmp_path):
    assert_one_line_error(run_cli("jobs", "status", "nope", "--root", tmp_path), "nope")
    assert_one_line_error(run_cli("jobs", "logs", "../etc", "--root", tmp_path), "invalid run name")


def test_launch_never_imports_torch():
    code = ("import sys, llmcluster.launch.launcher, llmcluster.launch.slurm, llmcluster.launch.k8s, "
            "llmcluster.launch.scheduler, llmcluster.launch.k8s.pod, llmcluster.launch.k8s.api, "
            "llmcluster.launch.cluster_defaults, "
            "llmcluster.launch.local, llmcluster.launch.jobs, llmcluster.cli.launch, llmcluster.cli.jobs, "
            "llmcluster.launch.skypilot, llmcluster.storage.bucket, llmcluster.cli.storage; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("key", ["run.name", "job.partition", "job.k8s.namespace", "job.image", "job.time",
                                 "job.mem_per_node", "log.metrics_bind"])
def test_a_trailing_newline_fails_every_validator(key):
    """`re.match` with `$` accepts "gpu\\n" (and breaks the #SBATCH header): every validator is a fullmatch."""
    from llmcluster.config.load import validate
    from llmcluster.config.schema import JobConfig
    from llmcluster.errors import UserError

    good = {"job.time": "01:00:00", "job.mem_per_node": "4G", "log.metrics_bind": "0.0.0.0:9401"}.get(key, "gpu")

    def config(value: str) -> dict:   # a YAML file can hold "gpu\n" ("|" block); --set strips it
        section, *rest = key.split(".")
        inner = {rest[-1]: value}
        for k in reversed(rest[:-1]):
            inner = {k: inner}
        return {section: inner}

    validate(config(good), JobConfig)
    with pytest.raises(UserError):
        validate(config(good + "\n"), JobConfig)


def test_no_validator_uses_re_match():
    """grep: every pattern check in the package is anchored by fullmatch (a tokenizer's match at a
    position, `_PART.match(expr, pos)`, is not a validator)."""
    p = subprocess.run(["grep", "-rnE", "--include=*.py", r"\.match\(",
                        str(Path(__file__).resolve().parents[1] / "llmcluster")],
                       capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if "fullmatch" not in ln and ".match(expr, pos)" not in ln
             and 're.match(r"\\s*(\\d+)", rate)' not in ln]
    assert not lines, lines


def test_secret_env_is_checked_and_never_rendered(tmp_path):
    """A missing secret is one line before anything runs; a present one is in no rendered file."""
    root = tmp_path / "s"
    args = ["launch", "--scheduler", "local", "--root", root, "--set", "job.secret_env=[LLMC_TEST_TOKEN]"]
    env = cli_env()
    env.pop("LLMC_TEST_TOKEN", None)
    assert_one_line_error(run_cli(*args, "--", "true", env=env), "LLMC_TEST_TOKEN", "not set")
    token = "tok-" + "x7" * 12
    digest = hashlib.sha256(token.encode()).hexdigest()               # the program names only its hash
    check = f'test "$(printf %s "$LLMC_TEST_TOKEN" | sha256sum | cut -c1-64)" = {digest}'
    p = run_cli(*args, "--", "bash", "-c", check, env=cli_env(LLMC_TEST_TOKEN=token))
    assert p.returncode == 0, p.stderr                                # it reached the rank
    for sched in ("slurm", "k8s"):
        dry = run_cli("launch", "--scheduler", sched, "--image", "img:1", "--root", root, "--dry-run",
                      "--set", "job.secret_env=[LLMC_TEST_TOKEN]", env=cli_env(LLMC_TEST_TOKEN=token))
        assert dry.returncode == 0 and "LLMC_TEST_TOKEN" in dry.stdout and token not in dry.stdout
    assert subprocess.run(["grep", "-rlF", token, str(root)], capture_output=True).returncode == 1


def test_cuda_allocator_preset_only_on_gpu_jobs_and_job_env_wins():
    from llmcluster.config.job import JobSpec

    assert JobSpec(gpus_per_node=8).environment()["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in JobSpec(gpus_per_node=0).environment()
    mine = JobSpec(gpus_per_node=8, env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}).environment()
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"


def test_flight_recorder_only_on_gpu_jobs_and_job_env_wins(tmp_path):
    from llmcluster.config.job import JobSpec
    from llmcluster.launch.spec import LaunchSpec

    def env(**job):
        return LaunchSpec(run="r", scheduler="local", root=tmp_path, job=JobSpec(**job), command=[]).rank_env()

    gpu = env(gpus_per_node=8, nccl="none")  # the recorder is not an NCCL tuning preset: always on a GPU job
    assert gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and gpu["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert gpu["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/logs/r/flight_recorder/rank_"
    assert not any(k.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE", "TORCH_NCCL_DUMP", "TORCH_NCCL_DEBUG_INFO"))
                   for k in env(gpus_per_node=0))
    # a user's setting under either name of a variable wins on every torch: ours is not set under the other
    mine = env(gpus_per_node=8, env={"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_", "TORCH_FR_BUFFER_SIZE": "0"})
    assert mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/scratch/fr_" and "TORCH_FR_DUMP_TEMP_FILE" not in mine
    assert mine["TORCH_FR_BUFFER_SIZE"] == "0" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine


def test_a_rank_aborted_by_a_signal_leaves_its_python_stacks_beside_the_flight_recorder(tmp_path):
    """The NCCL watchdog's SIGABRT runs no Python: a GPU rank has faulthandler append its stacks to
    logs/<run>/flight_recorder/python_rank_<r>.txt (here a real os.abort() in a real process; the rank
    calls crash_dumps on CUDA only, so the test calls it itself)."""
    dump = tmp_path / "logs" / "r" / "flight_recorder" / "rank_"
    code = ("from llmcluster.distributed.process_groups import crash_dumps\n"
            "def waiting_in_a_collective():\n    import os; os.abort()\n"
            "crash_dumps(3)\nwaiting_in_a_collective()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=cli_env(TORCH_FR_DUMP_TEMP_FILE=str(dump), TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(dump)))
    assert proc.returncode == -6, proc.stderr
    stacks = (dump.parent / "python_rank_3.txt").read_text()
    assert "Fatal Python error: Aborted" in stacks and "waiting_in_a_collective" in stacks


def test_a_refused_slurm_launch_leaves_no_launch_directory(tmp_path):
    """Issue 53: `launch --scheduler slurm` on a machine without sbatch is one line, and logs/<run>/launches/ is not
    left behind (nothing was submitted); an existing run's earlier launches stay."""
    (tmp_path / "bin").mkdir()
    env = cli_env(PATH=str(tmp_path / "bin"))   # no sbatch (nor git: the record's code_version is then null)
    root = tmp_path / "storage"
    proc = run_cli("launch", "--scheduler", "slurm", "--root", root, "-c", "llm_tiny", "--set", "run.name=nosb", env=env)
    assert_one_line_error(proc, "'sbatch' not found")
    assert not (root / "logs" / "nosb").exists()
    earlier = root / "logs" / "kept" / "launches" / "1"
    earlier.mkdir(parents=True)
    proc = run_cli("launch", "--scheduler", "slurm", "--root", root, "-c", "llm_tiny", "--set", "run.name=kept", env=env)
    assert_one_line_error(proc, "'sbatch' not found")
    assert sorted(p.name for p in (root / "logs" / "kept" / "launches").iterdir()) == ["1"]
