"""skypilot: the job rendered as a SkyPilot task (a YAML `sky launch` / `sky jobs launch` runs), for rented clouds.

The task, one field at a time (docs/launch.md, "SkyPilot"):
  * `num_nodes` and `resources.accelerators` from the cluster spec's `cloud:` section: a set of candidate
    {GPU: count} from the project's GPU table, named as SkyPilot's catalog names them; `use_spot` where asked.
  * The package comes from the checkout: `workdir` is this source tree (SkyPilot syncs it to every node) and
    `setup` pip-installs it into a venv of its own, torch first at the version this checkout runs with. Chosen
    over an image because the cloud VMs (Lambda's) boot SkyPilot's own image, and the tree that rendered the task
    is then exactly the code that trains.
  * `file_mounts` carries this launch's resolved config to the same path on the nodes.
  * `run` is SkyPilot's documented multi-node torchrun pattern: the head is the first of $SKYPILOT_NODE_IPS,
    $SKYPILOT_NUM_NODES nodes of $SKYPILOT_NUM_GPUS_PER_NODE ranks, $SKYPILOT_NODE_RANK this node's place. With
    `cloud.bucket`, node 0 first pulls the newest sealed step from it and copies each newly sealed step there while
    the run trains (storage/bucket.py): checkpoints outlive the cluster.
  * `secrets`: job.secret_env's names only; `sky` reads their values from the launching shell (`--secret NAME`).
  * A managed job (`sky jobs launch`) where the spec asks for spot or recovery; its `job_recovery` restarts the job
    on a new cluster after a preemption, also when the trainer exits with EXIT_PREEMPTED after its checkpoint.
No ft (per-step fault tolerance) here: the groups' Lighthouse and heal ports have no fence on a rented cluster yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from llmcluster.config.gpus import GPUS
from llmcluster.errors import EXIT_PREEMPTED, UserError
from llmcluster.launch.scheduler import Scheduler
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import ShellVar, comment_text, line_text, shell_export, shell_join, shell_word, yaml_text

# The project's GPU table names -> SkyPilot's catalog accelerator names (its `A100` is the 40 GB card). A table GPU
# missing here has no SkyPilot name and is refused.
SKY_ACCELERATORS = {"A100-40GB": "A100", "A100-80GB": "A100-80GB", "H100": "H100", "H200": "H200",
                    "L40S": "L40S", "RTX4090": "RTX4090"}
assert set(SKY_ACCELERATORS) <= set(GPUS)
SKY_CLOUDS = {"lambda": "lambda", "kubernetes": "kubernetes", "aws": "aws", "gcp": "gcp", "azure": "azure"}
NODE_VENV = "$HOME/llmcluster-venv"    # where `setup` installs the package on every node
PYTHON_ENV = "LLMCLUSTER_PYTHON"       # the nodes' python (default: NODE_VENV's); a test points it elsewhere
PUSH_EVERY_S = 60                      # how often node 0 copies newly sealed steps to the bucket while training
PUSH_EVERY_ENV = "LLMCLUSTER_PUSH_EVERY_S"   # ... unless the task's environment says otherwise (`sky --env`)
SKY_ENV = "LLMCLUSTER_SKY"             # the `sky` program (default: `sky` on PATH, else `make sky`'s venv)


def torch_pin() -> str:
    """The torch version this checkout runs with, read from its metadata (launch never imports torch); the public
    release without a local build tag (+cpu): the nodes' pip picks their own build of it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").split("+")[0]
    except PackageNotFoundError:
        return "2.6.0"   # pyproject.toml's floor


def source_tree() -> Path:
    """The checkout this package runs from: SkyPilot's workdir. An installed wheel has none."""
    src = Path(__file__).resolve().parents[2]
    if not (src / "pyproject.toml").is_file():
        raise UserError(f"--scheduler skypilot ships the source checkout as the task's workdir; {src} is not one "
                        "(run llmcluster from a clone)")
    return src


def accelerators(spec: LaunchSpec) -> dict[str, int]:
    """The candidate GPU sets as SkyPilot names them: cloud.accelerators, else the cluster's hardware GPU."""
    out = {}
    for gpu, count in spec.cloud.accelerators.items():
        if gpu not in SKY_ACCELERATORS:
            raise UserError(f"cloud.accelerators: {gpu} has no SkyPilot catalog name here "
                            f"(one of {', '.join(SKY_ACCELERATORS)})")
        out[SKY_ACCELERATORS[gpu]] = count
    return out


def managed(spec: LaunchSpec) -> bool:
    """A managed job (`sky jobs launch`): spot capacity, or recovery asked for."""
    return spec.cloud.use_spot or spec.cloud.recovery


def run_block(spec: LaunchSpec) -> str:
    """The task's `run`: bash, once per node, under the SKYPILOT_* variables SkyPilot sets."""
    j, cloud = spec.job, spec.cloud
    py = ShellVar("$py")
    argv = spec.torchrun(py, ShellVar("$MASTER_ADDR:$rdzv_port"), spec.run, None, ShellVar("$SKYPILOT_NODE_RANK"))
    # the documented pattern: nodes and ranks per node from SkyPilot, not from the config (a candidate set may
    # give 4 or 8 GPUs a node)
    for flag, var in (("--nnodes", "$SKYPILOT_NUM_NODES"), ("--nproc-per-node", "$SKYPILOT_NUM_GPUS_PER_NODE")):
        argv[argv.index(flag) + 1] = ShellVar(var)
    lines = ["set -uo pipefail", "umask 027",
             f'py=${{{PYTHON_ENV}:-{NODE_VENV}/bin/python}}',
             'MASTER_ADDR=$(echo "$SKYPILOT_NODE_IPS" | head -n1)',
             f"rdzv_port={j.rdzv_port}"]
    lines += [shell_export(k, v) for k, v in spec.rank_env().items()]
    bucket = cloud.bucket
    if bucket:
        storage = [py, "-m", "llmcluster", "storage"]
        pull = shell_join([*storage, "pull", spec.run, "--from", bucket, "--root", spec.storage])
        push = shell_join([*storage, "push", spec.run, "--to", bucket, "--root", spec.storage])
        lines += ["# node 0 keeps the checkpoints' copy in the bucket (the other nodes wait for it in the rendezvous)",
                  'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then',
                  f"  {pull} || exit $?",
                  f'  ( while sleep "${{{PUSH_EVERY_ENV}:-{PUSH_EVERY_S}}}"; do {push}; done ) &',
                  "  pusher=$!",
                  "fi"]
    lines += [shell_join(argv), "rc=$?"]
    if bucket:
        lines += ['if [ "$SKYPILOT_NODE_RANK" = 0 ]; then', '  kill "$pusher" 2>/dev/null; wait "$pusher" 2>/dev/null',
                  f"  {push} || exit $?", "fi"]
    lines.append('exit "$rc"')
    return "\n".join(lines) + "\n"


def task(spec: LaunchSpec) -> dict:
    """The SkyPilot task as a mapping (SkyPilot's task YAML schema, 0.14)."""
    cloud = spec.cloud
    resources: dict = {"infra": SKY_CLOUDS[cloud.provider] + (f"/{cloud.region}" if cloud.region else ""),
                       "accelerators": accelerators(spec)}
    if cloud.use_spot:
        resources["use_spot"] = True
    if cloud.disk_size_gb:
        resources["disk_size"] = cloud.disk_size_gb
    if managed(spec):
        resources["job_recovery"] = {"strategy": "EAGER_NEXT_REGION",
                                     "max_restarts_on_errors": cloud.max_restarts_on_errors,
                                     "recover_on_exit_codes": [EXIT_PREEMPTED]}
    pin = torch_pin()
    setup = "\n".join([
        "set -euo pipefail",
        f"python3 -m venv {NODE_VENV}",
        f"{NODE_VENV}/bin/pip install -q {shell_word('torch==' + pin)}",
        f"{NODE_VENV}/bin/pip install -q {shell_word('torch==' + pin)} .",   # the workdir: this checkout
    ]) + "\n"
    out = {"name": spec.run, "workdir": str(source_tree()), "num_nodes": spec.job.nodes, "resources": resources,
           "file_mounts": {str(spec.config_path): str(spec.config_path)}, "setup": setup, "run": run_block(spec)}
    if spec.job.secret_env:
        out["secrets"] = dict.fromkeys(spec.job.secret_env)   # names only: `sky` reads the values at launch
    return out


def sky_program() -> str:
    """`sky`: $LLMCLUSTER_SKY, else on PATH, else the one `make sky` built."""
    if os.environ.get(SKY_ENV):
        return line_text(os.environ[SKY_ENV], SKY_ENV)
    found = shutil.which("sky")
    if found:
        return found
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcluster"
    # the newest complete build (an older key's venv may remain beside it until removed)
    built = sorted((p for p in cache.glob("sky-*/bin/sky") if (p.parent.parent / ".installed").is_file()),
                   key=lambda p: (p.parent.parent / ".installed").stat().st_mtime)
    if built:
        return str(built[-1])
    raise UserError("no `sky` program: run `make sky` (SkyPilot in a venv of its own), or put sky on PATH")


# SkyPilot's job states (`sky jobs queue`, `sky queue`) as the project's: the active ones map onto ACTIVE_STATES
STATES = {"INIT": "PENDING", "PENDING": "PENDING", "SUBMITTED": "PENDING", "STARTING": "PENDING",
          "SETTING_UP": "PENDING", "RECOVERING": "PENDING", "RUNNING": "RUNNING", "CANCELLING": "COMPLETING",
          "SUCCEEDED": "COMPLETED", "CANCELLED": "CANCELLED", "FAILED": "FAILED", "FAILED_SETUP": "FAILED",
          "FAILED_DRIVER": "FAILED", "FAILED_PRECHECKS": "FAILED", "FAILED_NO_RESOURCE": "FAILED",
          "FAILED_CONTROLLER": "FAILED"}


def table_status(text: str, run: str) -> str | None:
    """The STATUS of `run`'s first row in a table `sky jobs queue` / `sky queue` prints (columns are separated by
    two or more spaces; the first row is the newest), or None."""
    import re

    header = None
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if header is None:
            if "NAME" in cells and "STATUS" in cells:
                header = cells
            continue
        if len(cells) == len(header) and cells[header.index("NAME")] == run:
            return cells[header.index("STATUS")]
    return None


def sky(args: list[str], capture: bool = True) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sky_program(), *args], capture_output=capture, text=True, timeout=600, check=False)
    except OSError as e:
        raise UserError(f"cannot run sky: {e.strerror or e}") from None


class SkyPilot(Scheduler):
    name = "skypilot"
    artifact = "task.yaml"

    def check(self, spec: LaunchSpec) -> None:
        if spec.cloud is None:
            raise UserError("--scheduler skypilot needs a cluster spec with a cloud: section "
                            "(e.g. --cluster lambda-a100)")
        if spec.ft:
            raise UserError("ft.enabled is not supported on --scheduler skypilot yet (no fence for the groups' "
                            "ports on a rented cluster): set ft.enabled false, or use slurm or k8s")
        if spec.generic:
            raise UserError("--scheduler skypilot runs the trainer only (no `-- CMD` program)")
        accelerators(spec)
        source_tree()

    def render(self, spec: LaunchSpec) -> str:
        head = f"# llmcluster launch: run {comment_text(spec.run)} on {spec.cloud.provider} through SkyPilot\n"
        return head + yaml_text([task(spec)])

    def submit(self, spec: LaunchSpec, artifact: Path, record: dict, write_record, **flags) -> int:
        secrets = [w for n in spec.job.secret_env for w in ("--secret", n)]
        missing = [n for n in spec.job.secret_env if n not in os.environ]
        if missing:
            raise UserError(f"job.secret_env: {', '.join(missing)} not set in this environment")
        if managed(spec):
            args = ["jobs", "launch", "-y", "-n", spec.run, *secrets, str(artifact)]
        else:
            args = ["launch", "-y", "-c", spec.run, *secrets, str(artifact)]
        record["skypilot"] = {"managed": managed(spec), "cluster": spec.run}
        write_record({**record, "job_id": spec.run, "state": "SUBMITTED"})
        rc = sky(args, capture=False).returncode
        if rc:
            write_record({**record, "job_id": spec.run, "state": "FAILED", "exit_code": rc})
            print(f"[llmcluster] sky {' '.join(args[:2])} exited with {rc}", file=sys.stderr)
        return rc

    # -- jobs status|logs|cancel: asked of sky, by the run's name (the managed job's, or the cluster's) --
    @staticmethod
    def _managed(rec: dict) -> bool:
        sp = rec.get("skypilot")
        return bool(sp.get("managed")) if isinstance(sp, dict) else False

    def state(self, logs: Path, rec: dict) -> dict:
        if not rec.get("job_id"):
            return {"state": rec.get("state", "UNKNOWN")}
        run = line_text(rec["run"], "run")
        p = sky(["jobs", "queue"] if self._managed(rec) else ["queue", run])
        if p.returncode:
            raise UserError(f"sky could not say how {run} stands: {(p.stderr or p.stdout).strip()[-200:]}")
        status = table_status(p.stdout, run)
        if status is None:
            return {"state": "LOST", "detail": f"sky lists no job named {run}"}
        return {"state": STATES.get(status, status), "detail": f"sky: {status}"}

    def logs(self, logs: Path, rec: dict, follow: bool) -> int:
        run = line_text(rec["run"], "run")
        args = ["jobs", "logs", "-n", run] if self._managed(rec) else ["logs", run]
        return sky(args + ([] if follow else ["--no-follow"]), capture=False).returncode

    def cancel(self, logs: Path, rec: dict) -> str | None:
        """A managed job: cancelled (SkyPilot tears its cluster down). A cluster's job: cancelled (torchrun forwards
        the SIGTERM, the ranks checkpoint), then the cluster is torn down, so it stops costing; the sealed steps are
        in the bucket."""
        run = line_text(rec["run"], "run")
        steps = [["jobs", "cancel", "-y", "-n", run]] if self._managed(rec) else \
            [["cancel", "-y", "--all", run], ["down", "-y", run]]
        for args in steps:
            p = sky(args)
            if p.returncode:
                raise UserError(f"sky {' '.join(args[:2])} {run} failed: {(p.stderr or p.stdout).strip()[-200:]}")
        return None
