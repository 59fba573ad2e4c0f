"""Slurm: render an sbatch script from a LaunchSpec, and submit / query / cancel through the Slurm CLIs.

The script runs one task per node; each task is a torchrun agent, and the agents meet at a c10d rendezvous
on the first node of the allocation. Preemption is handled in two layers:
  * `--signal=B:USR2@N` signals the batch shell N seconds before the time limit; its trap forwards USR2 to
    srun, which delivers it to every process of the step (torchrun agents and ranks). The ranks agree to
    stop at the next step boundary, checkpoint and exit 75 ("requeue me").
  * torchrun reports any worker exit as 1, so the trainer's 75 does not survive it: the shell requeues when
    srun fails after the signal arrived (or exits 75, e.g. a launcher that keeps the code), while
    SLURM_RESTART_COUNT < max_requeues. The requeued job resumes from the last complete checkpoint.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from llmcluster.errors import EXIT_PREEMPTED, UserError
from llmcluster.launch.spec import LaunchSpec, ShellVar, sh, sh_join

# values in #SBATCH lines are parsed by sbatch, not by a shell: they cannot be quoted, only refused
SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_./:@%+=,-]+$")


def _sbatch_value(value: str, what: str) -> str:
    if not SBATCH_SAFE.match(value):
        raise UserError(f"{what} {value!r} cannot go into an #SBATCH line "
                        "(letters, digits and ._/:@%+=,- only)")
    return value


def render(spec: LaunchSpec) -> str:
    """The sbatch script (a pure function of the spec)."""
    j = spec.job
    logs = str(spec.logs)
    head = [
        "#!/bin/bash",
        f"# llmcluster launch: run {spec.run}, {j.nodes} node(s) x {j.procs} process(es), "
        f"world size {j.world_size}",
        f"#SBATCH --job-name={_sbatch_value(spec.run, 'run name')}",
        f"#SBATCH --nodes={j.nodes}",
        "#SBATCH --ntasks-per-node=1",           # one torchrun agent per node; it starts the ranks
    ]
    if j.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={j.gpus_per_node}")
    if j.cpus_per_node:
        head.append(f"#SBATCH --cpus-per-task={j.cpus_per_node}")
    if j.mem_per_node:
        head.append(f"#SBATCH --mem={j.mem_per_node}")
    head.append(f"#SBATCH --time={j.time}")
    if j.partition:
        head.append(f"#SBATCH --partition={j.partition}")
    if j.account:
        head.append(f"#SBATCH --account={j.account}")
    head += [
        f"#SBATCH --output={_sbatch_value(logs, 'log directory')}/slurm-%j.out",
        "#SBATCH --open-mode=append",            # a requeued attempt appends to the same log
        f"#SBATCH --signal=B:USR2@{j.signal_before_s}",
        "#SBATCH --requeue",
        "",
        "set -uo pipefail",
    ]
    env = {**j.environment(), "LLMCLUSTER_STORAGE": str(spec.root)}
    if j.gpus_per_node == 0:
        env.setdefault("OMP_NUM_THREADS", "1")   # CPU ranks: no oversubscription by default
    head += [f"export {k}={sh(v)}" for k, v in env.items()]

    srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", f"--nodes={j.nodes}"]
    if j.image:
        mounts = [f"{spec.root}:{spec.root}"] + [
            f"{m.source}:{m.path}" + (":ro" if m.read_only else "") for m in j.mounts]
        srun += [f"--container-image={j.image}", f"--container-mounts={','.join(mounts)}",
                 f"--container-workdir={spec.root}"]
    rdzv = ["--nnodes", str(j.nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", ShellVar("$head:$rdzv_port"), "--rdzv-id", ShellVar("$SLURM_JOB_ID")]
    log_dir = ShellVar("$ranks_dir")
    srun += spec.torchrun(spec.python, rdzv, log_dir)

    body = [
        "",
        "# rendezvous on the first node of the allocation; a port per job so jobs sharing a node don't collide",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port=$(( {j.rdzv_port} + SLURM_JOB_ID % 1000 ))",
        f'ranks_dir={sh(logs)}/ranks/"$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"',
        'mkdir -p "$ranks_dir"',
        'echo "[llmcluster] job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0}:'
        ' nodes $SLURM_JOB_NODELIST, rendezvous $head:$rdzv_port"',
        "",
        "# the pre-time-limit signal: pass it on to every process of the step (torchrun and the ranks)",
        "preempted=0",
        "trap 'preempted=1; echo \"[llmcluster] SIGUSR2: checkpoint and stop\"; "
        "kill -USR2 \"$srun_pid\" 2>/dev/null' USR2",
        sh_join(srun) + " &",
        "srun_pid=$!",
        "# `wait` returns early (status > 128) when a trapped signal arrives: wait again until srun is gone",
        "while :; do",
        '  wait "$srun_pid"; rc=$?',
        '  [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null && continue',
        "  break",
        "done",
        'echo "[llmcluster] srun exited with $rc"',
        "",
        f"# {EXIT_PREEMPTED} = the trainer checkpointed and asks to be requeued (torchrun turns it into 1)",
        f'if [ "$rc" -ne 0 ] && {{ [ "$rc" -eq {EXIT_PREEMPTED} ] || [ "$preempted" = 1 ]; }}; then',
        f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {j.max_requeues} ]; then',
        '    echo "[llmcluster] requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0} of '
        f'{j.max_requeues})"',
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


def submit(script_path: str) -> str:
    """sbatch --parsable -> the job id."""
    p = _call(["sbatch", "--parsable", script_path])
    if p.returncode != 0:
        raise UserError(f"sbatch failed: {' '.join(p.stderr.split()) or p.returncode}")
    return p.stdout.strip().split(";")[0]          # "<id>[;cluster]"


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


def cancel(job_id: str) -> None:
    p = _call(["scancel", job_id])
    if p.returncode != 0:
        raise UserError(f"scancel {job_id} failed: {' '.join(p.stderr.split())}")
