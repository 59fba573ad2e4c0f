"""Slurm: render an sbatch script from a LaunchSpec, and submit / query / cancel through the Slurm CLIs.

The script runs one task per node; each task is a torchrun agent, and the agents meet at a c10d rendezvous
on the first node of the allocation, addressed by its NodeAddr from `scontrol show node` (a NodeName need
not resolve) at a port the script finds free there. Failures are handled in three layers:
  * a rank that dies (segfault, OOM, an NCCL error) makes its torchrun agent restart the whole group, up to
    job.max_restarts times; the ranks resume from the last complete checkpoint;
  * `--signal=B:USR2@N` signals the batch shell N seconds before the time limit; its trap forwards USR2 to
    srun, which delivers it to every process of the step. The ranks checkpoint and exit 75;
  * when srun fails (the signal, restarts used up, a node lost) the shell requeues the job while
    SLURM_RESTART_COUNT < job.max_requeues, unless the trainer wrote that the failure is `fatal` (a restart
    would repeat it: see storage/exit_reason.py). The requeued job resumes from the last complete checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from llmcluster.errors import EXIT_PREEMPTED, UserError
from llmcluster.launch import slurm_ft
from llmcluster.launch.scheduler import ACTIVE_STATES, Command, Scheduler
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import (Program, ShellVar, argv_element, comment_text, directive_path, directive_value,
                               list_item, sha256_check, shell_export, shell_join, shell_word)
from llmcluster.launch.ft_auth import create_secret
from llmcluster.storage.exit_reason import EXIT_DIR_ENV

JOB_ID = re.compile(r"\d+(?:_\d+)?")
# The first free port from BASE + job id % 1000 on (jobs sharing a head node start apart, and a port some
# other program holds is skipped). Runs on the batch host, which is the first node of the allocation.
FREE_PORT = Program("import socket, sys\n"
             "for p in range(int(sys.argv[1]), 65536):\n"
             "    with socket.socket() as s:\n"
             "        try:\n"
             "            s.bind((\"\", p)); print(p); break\n"
             "        except OSError: pass\n")


def render(spec: LaunchSpec) -> str:
    """The sbatch script (a pure function of the spec)."""
    j = spec.job
    logs = str(spec.logs)
    head = [
        "#!/bin/bash",
        f"# llmcluster launch: run {comment_text(spec.run)}, {j.nodes} node(s) x {j.procs} process(es), "
        f"world size {j.world_size}",
        f"#SBATCH --job-name={directive_value(spec.run, 'run name')}",
        f"#SBATCH --nodes={j.nodes + (spec.ft.spare_nodes if spec.ft else 0)}",
        "#SBATCH --ntasks-per-node=1",           # one torchrun agent per node; it starts the ranks
    ]
    if spec.ft:   # a lost node ends its steps only: the dead group moves to a spare node (launch/slurm_ft.py)
        head += [f"# ft: {spec.ft.spare_nodes} spare node(s) (ft.spare_nodes) after the groups' {j.nodes}",
                 "#SBATCH --no-kill",
                 # its fence (launch/fence.py) admits every process on the job's nodes: no other job shares them
                 # (another user's job there would reach the unauthenticated TCPStores and the Lighthouse's kill)
                 "#SBATCH --exclusive"]
    if j.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={j.gpus_per_node}")
    if j.cpus_per_node:
        head.append(f"#SBATCH --cpus-per-task={j.cpus_per_node}")
    if j.mem_per_node:
        head.append(f"#SBATCH --mem={directive_value(j.mem_per_node, 'job.mem_per_node')}")
    head.append(f"#SBATCH --time={directive_value(j.time, 'job.time')}")
    if j.partition:
        head.append(f"#SBATCH --partition={directive_value(j.partition, 'job.partition')}")
    if j.account:
        head.append(f"#SBATCH --account={directive_value(j.account, 'job.account')}")
    head += [
        f"#SBATCH --output={directive_path(logs, 'log directory')}/slurm-%j.out",
        "#SBATCH --open-mode=append",            # a requeued attempt appends to the same log
        f"#SBATCH --signal=B:USR2@{j.signal_before_s}",
        "#SBATCH --requeue",
        "",
        "set -uo pipefail",
        "umask 027                                # run files 0640, directories 0750",
        "# the config this launch recorded, unchanged (job.json's config_sha256), or no training: a queued or",
        "# requeued job reads launches/<n>/config.yaml when it starts, long after the launch",
        f"config_sha256={spec.config_sha256}",
        # one line (a word list bash reads as data, like every line that names a path: tests/test_render_boundary.py)
        sha256_check(spec.config_path, '"$config_sha256"',
                     f"[llmcluster] refusing to train: {spec.config_path} is not the config launch {spec.launch_id} "
                     "recorded (job.json's config_sha256): changed or replaced since"),
    ]
    head += [shell_export(k, v) for k, v in spec.rank_env().items()]
    if j.secret_env:
        head += ["# job.secret_env: from the submitting environment (sbatch --export=ALL), never written here",
                 f"for v in {shell_join(j.secret_env)}; do",
                 '  [ -n "${!v+x}" ] || { echo "[llmcluster] job.secret_env: $v is not in the job\'s '
                 'environment" >&2; exit 2; }',
                 "done"]

    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
    container = []
    if j.image:
        # pyxis splits this list on ',' and each item on ':': a path holding either would mount something else
        item = lambda p, what: list_item(p, what, ",:")  # noqa: E731
        mounts = [f"{item(spec.root, 'storage root')}:{item(spec.root, 'storage root')}"] + [
            f"{item(m.source, 'job.mounts.source')}:{item(m.path, 'job.mounts.path')}" + (":ro" if m.read_only else "")
            for m in j.mounts]
        container = [f"--container-image={j.image}", f"--container-mounts={','.join(mounts)}",
                     f"--container-workdir={spec.root}"]
    port_python = "python3" if j.image else spec.python   # the batch host's own interpreter
    free_port = f"{shell_word(port_python)} -c {shell_word(FREE_PORT)}"
    body = [
        "",
        "# rendezvous on the first node at the address Slurm uses for it (NodeAddr: node names need not",
        "# resolve), on a port free there (this script runs on that node)",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head=$(scontrol show node -o "$head_node" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
        'head=${head:-$head_node}',
    ]
    if not spec.ft:
        body.append(f'rdzv_port=$({free_port} "$(( {j.rdzv_port} + SLURM_JOB_ID % 1000 ))")')
    body += [
        f'ranks_dir={shell_word(logs)}/ranks/"$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"',
        'mkdir -p "$ranks_dir"',
        f'export {EXIT_DIR_ENV}="$ranks_dir"       # the ranks say why they stopped (storage/exit_reason.py)',
        'echo "[llmcluster] job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}: nodes $SLURM_JOB_NODELIST'
        + ('"' if spec.ft else ', rendezvous $head:$rdzv_port (node $head_node)"'),
    ]
    if spec.ft:
        body += slurm_ft.body(spec, srun, port_python, free_port, container)
    else:
        srun += [f"--nodes={j.nodes}", *container,
                 *spec.torchrun(spec.python, ShellVar("$head:$rdzv_port"), ShellVar("$SLURM_JOB_ID"),
                                ShellVar("$ranks_dir"))]
        body += [
            "",
            "# the pre-time-limit signal: pass it on to every process of the step (torchrun and the ranks)",
            "preempted=0",
            "trap 'preempted=1; echo \"[llmcluster] SIGUSR2: checkpoint and stop\"; "
            "kill -USR2 \"$srun_pid\" 2>/dev/null' USR2",
            shell_join(srun) + " &",
            "srun_pid=$!",
            "# `wait` returns early (status > 128) when a trapped signal arrives: wait again until srun is gone",
            "while :; do",
            '  wait "$srun_pid"; rc=$?',
            '  [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null && continue',
            "  break",
            "done",
            'echo "[llmcluster] srun exited with $rc"',
        ]
    body += [
        "",
        f"# requeue a failed attempt (preempted: the trainer exits {EXIT_PREEMPTED}, torchrun turns it into 1;",
        "# a runtime failure torchrun's restarts did not cure) unless a rank said a restart would repeat it",
        'fatal=$(cat "$ranks_dir"/exit-rank* "$ranks_dir"/group-*/exit-rank* 2>/dev/null | grep -m 1 "^fatal")',
        'if [ "$rc" -ne 0 ] && [ "$preempted" = 0 ] && [ -n "$fatal" ]; then',
        '  echo "[llmcluster] not requeueing: $fatal"',
        'elif [ "$rc" -ne 0 ]; then',
        f'  why=$([ "$preempted" = 1 ] || [ "$rc" -eq {EXIT_PREEMPTED} ] && echo preempted || echo "runtime failure")',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {j.max_requeues} ]; then',
        '    echo "[llmcluster] requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0} of '
        f'{j.max_requeues}): $why"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "  else",
        f'    echo "[llmcluster] not requeueing: {j.max_requeues} requeue(s) used"',
        "  fi",
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(head + body) + "\n"


# -- the Slurm CLIs ------------------------------------------------------------------------------------

def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UserError(f"'{name}' not found: is this a Slurm login node? (scripts/slurm_up.sh brings up "
                        "a local test cluster)")
    return path


def _call(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([_tool(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout)


def sbatch_argv(script_path, options: list[str] = ()) -> list[str]:
    """sbatch's command line for a script (pure): --parsable (the id alone on stdout), then `options`, then
    --export=ALL: the submitting environment (job.secret_env among it) reaches the job without being written
    into the script."""
    script = argv_element(script_path, "batch script", positional=True)
    return ["sbatch", "--parsable", *options, "--export=ALL", script]


def submit(script_path, options: list[str] = ()) -> str:
    """Submit the script -> the job id. umask 027 makes the job's output files 0640."""
    old = os.umask(0o027)
    try:
        p = _call(sbatch_argv(script_path, options))
    finally:
        os.umask(old)
    if p.returncode != 0:
        raise UserError(f"sbatch failed: {' '.join(p.stderr.split()) or p.returncode}")
    return p.stdout.strip().split(";")[0]          # "<id>[;cluster]"


# -- a command as a job of its own (scheduler.Command: the trainer's downstream evaluations) ----------------------

def command_script(title: str, argv: list[str]) -> str:
    """A command job's batch script (pure: the text only). The title through comment_text (it cannot end the line
    early), the command through shell_join."""
    return f"#!/bin/bash\n# llmcluster: {comment_text(title)}\nexec {shell_join(argv)}\n"


def command_options(name: str, output: Path) -> list[str]:
    """sbatch's options for a command job (pure). The job name is a directive value (its small grammar); the
    output path a directive path (its grammar, '%' doubled: sbatch reads %j-style patterns in it)."""
    return [f"--job-name={directive_value(name, 'job name')}", f"--output={directive_path(output, 'job output')}",
            "--nodes=1"]


def _job_id(rec: dict) -> str:
    jid = str(rec.get("job_id") or "")
    if not JOB_ID.fullmatch(jid):
        raise UserError(f"job.json of {rec.get('run')!r} has no valid Slurm job id ({jid!r})")
    return jid


def state(job_id: str) -> dict:
    """{'state': 'RUNNING'|'COMPLETED'|..., 'exit_code': '0:0', 'restarts': n, 'nodes': ...}.

    squeue for jobs that are pending or running, then sacct (the accounting database), then
    `scontrol show job` (the controller keeps finished jobs for MinJobAge seconds)."""
    p = _call(["squeue", "-h", "-j", job_id, "-o", "%T|%R"])
    if p.returncode == 0 and p.stdout.strip():
        st, where = p.stdout.strip().splitlines()[0].split("|", 1)
        info = _scontrol(job_id) or {}
        return {"state": st, "nodes": where, "restarts": int(info.get("Restarts", 0) or 0),
                "exit_code": info.get("ExitCode")}
    p = _call(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList"])
    if p.returncode == 0 and p.stdout.strip():
        st, code, nodes = p.stdout.strip().splitlines()[-1].split("|")[:3]
        return {"state": st.split()[0], "exit_code": code, "nodes": nodes}
    info = _scontrol(job_id)
    if info:
        return {"state": info.get("JobState", "UNKNOWN"), "exit_code": info.get("ExitCode"),
                "nodes": info.get("NodeList"), "restarts": int(info.get("Restarts", 0) or 0)}
    return {"state": "UNKNOWN"}


def _scontrol(job_id: str) -> dict | None:
    p = _call(["scontrol", "show", "job", "-o", job_id])
    if p.returncode != 0 or not p.stdout.strip():
        return None
    fields = {}
    for word in p.stdout.split():
        if "=" in word:
            k, v = word.split("=", 1)
            fields.setdefault(k, v)
    return fields


class Slurm(Scheduler):
    name = "slurm"
    artifact = "job.sbatch"
    runs_commands = True

    def render(self, spec: LaunchSpec) -> str:
        return render(spec)

    def submit(self, spec: LaunchSpec, artifact: Path, record: dict, write_record, **flags) -> int:
        if missing := [n for n in spec.job.secret_env if n not in os.environ]:
            raise UserError(f"job.secret_env: {', '.join(missing)} not set in this environment")
        if spec.ft:   # the run's secret (launch/ft_auth.py) on the shared storage, before the job can start
            create_secret(spec.logs / "ft")
        job_id = submit(str(artifact))
        write_record({**record, "job_id": job_id})
        print(f"submitted {spec.run} as Slurm job {job_id}; log: {spec.logs}/slurm-{job_id}.out")
        return 0

    def state(self, logs: Path, rec: dict) -> dict:
        return state(_job_id(rec))

    def log_files(self, logs: Path, rec: dict) -> list[Path]:
        return [logs / f"slurm-{_job_id(rec)}.out"]

    def cancel(self, logs: Path, rec: dict) -> None:
        job_id = _job_id(rec)
        # job.json is a file anyone with write access to logs/ can edit: cancel the id only if Slurm
        # says that job is this run (its job name), so a doctored record cannot stop someone else's job
        info = _scontrol(job_id)
        if info is None or info.get("JobName") != rec["run"]:
            raise UserError(f"Slurm job {job_id} is not run {rec['run']!r} "
                            f"({'unknown to Slurm' if info is None else 'named ' + repr(info.get('JobName'))})")
        p = _call(["scancel", job_id])
        if p.returncode != 0:
            raise UserError(f"scancel {job_id} failed: {' '.join(p.stderr.split())}")

    def submit_command(self, cmd: Command) -> dict:
        script = cmd.output.with_suffix(".sh")
        script.write_text(command_script(cmd.title, cmd.argv))
        return {"job_id": submit(script, command_options(cmd.name, cmd.output))}

    def command_active(self, rec: dict, marks: tuple[str, ...]) -> bool:
        job_id = rec.get("job_id")
        if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
            return False
        try:
            return state(job_id)["state"] in ACTIVE_STATES
        except (UserError, OSError, subprocess.TimeoutExpired):
            return True      # unknown: keep the checkpoint rather than delete what may still be read
