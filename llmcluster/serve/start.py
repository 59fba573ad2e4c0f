"""`llmcluster serve start`: vLLM for a model, launched as a named job (local process, Slurm, Kubernetes), then
checked: /health, then a one-token completion (vLLM accepts a model it cannot run until the first request).

Serving jobs are recorded like training launches (logs/<name>/job.json with "kind": "serve", the rendered artifact
read-only under logs/<name>/launches/<n>/), so `jobs status|logs|cancel NAME` work on them through each
scheduler's own code. No torch here.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llmcluster.errors import RunFailure, UserError
from llmcluster.launch.local import SERVER_LOG
from llmcluster.launch.launcher import UMASK
from llmcluster.storage.job_record import make_launch_dir, read_record, write_once, write_record
from llmcluster.launch.scheduler import ACTIVE_STATES, get
from llmcluster.launch.spec import next_launch_id
from llmcluster.serve import auth
from llmcluster.serve import engine as eng
from llmcluster.render import (ShellVar, comment_text, directive_path, directive_value, line_text, owned_check,
                               sha256_check, shell_join, shell_word)
from llmcluster.serve.engine_check import engine_warnings

ENDPOINT = "endpoint-{job}"        # a Slurm job writes its URL here once /health answers
PROGRESS_S = 10


@dataclass(frozen=True)
class ServeJob:
    name: str                      # the job (logs/<name>/, Slurm job name, k8s object names)
    scheduler: str
    root: Path
    engine: eng.Engine
    target: eng.Target
    sizing: eng.Sizing
    host: str
    port: int
    launch_id: int
    slo_ttft_p99_ms: float | None = None   # serve.slo: `monitor config` alerts above it
    auth: bool = True              # vLLM requires the job's API key (--no-auth: it answers anyone who reaches it)
    lineage: dict | None = None    # the served export's lineage digest (export/lineage.py `served`), for job.json

    @property
    def logs(self) -> Path:
        return self.root / "logs" / self.name

    @property
    def launch_dir(self) -> Path:
        return self.logs / "launches" / str(self.launch_id)

    @property
    def key_file(self) -> Path | None:
        return self.logs / auth.KEY_FILE if self.auth else None

    @property
    def served(self) -> str:
        """The model name requests give: the export's (the adapter's, for a LoRA export)."""
        return self.target.name

    def argv(self, host: str | None = None, port: int | str | None = None) -> list[str]:
        return eng.argv(self.engine, self.target, self.sizing, self.served, host or self.host, port or self.port,
                        guard=self.auth)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def key_lines(job: ServeJob, fail: str) -> list[str]:
    """The job's API key into vLLM's environment, read from its 0600 file when the script runs: the key itself is
    in no rendered artefact and on no command line. `fail` ends the script when the file cannot be read. The
    guard (--middleware, every route but the open ones needs the key) is imported from the launch directory:
    written once, read-only, holding no other module (a PYTHONPATH entry comes before the standard library)."""
    if job.key_file is None:
        return ["# --no-auth: the server answers anyone who reaches it"]
    return [f"{auth.ENV}=$(cat -- {shell_word(job.key_file)}) || {fail}", f"export {auth.ENV}",
            f"export PYTHONPATH={shell_word(job.launch_dir)}"]


def start_checks(job: ServeJob) -> list[str]:
    """A queued Slurm job reads logs/<name>/ when it starts, long after `serve start`: where a group member can
    rename entries of logs/ (no sticky bit), they could put their own logs/<name> in its place, their guard
    imported as the caller's code, their key the server's. So, as the training script checks its config:
    logs/<name> is the caller's own directory (not a link), the guard has the sha256 rendered here, the key file
    is the caller's own regular file (storage/owned.py's rule); one line and exit 2 otherwise."""
    import hashlib

    why = "replaced or changed since serve start"
    lines = [owned_check(job.logs, f"[llmcluster] refusing to serve: {job.logs} is not this user's own directory "
                                   f"(a link, or another user's): {why}", "-d")]
    if job.key_file is None:
        return lines
    guard = job.launch_dir / auth.GUARD_FILE
    return lines + [
        f"guard_sha256={hashlib.sha256(auth.guard_source().encode()).hexdigest()}",
        sha256_check(guard, '"$guard_sha256"', f"[llmcluster] refusing to serve: {guard} is not the guard serve start "
                                              f"{job.launch_id} wrote: {why}"),
        owned_check(job.key_file, f"[llmcluster] refusing to serve: {job.key_file} is not this user's own file (a "
                                  f"link, another user's, not a regular file): {why}")]


def env_lines(job: ServeJob, fail: str) -> list[str]:
    """The engine's variables exported, its key read (key_lines), then the allow-list the server runs under
    (engine.allow_list_lines): what this script exported and the few of the caller's the engine needs."""
    env = eng.environment(job.engine)
    lines = [f"export {k}={shell_word(v)}" for k, v in env.items()] + key_lines(job, fail)
    exported = [*env, *((auth.ENV, "PYTHONPATH") if job.key_file is not None else ())]
    return lines + eng.allow_list_lines(exported)


# -- local: a detached process ------------------------------------------------------------------------------------

def render_local(job: ServeJob) -> str:
    lines = ["#!/bin/bash", f"# llmcluster serve start: {comment_text(job.served)} as job {comment_text(job.name)} "
             "on this machine",
             "set -euo pipefail", "umask 027"]
    lines += env_lines(job, "exit 1")
    lines.append("exec " + eng.ENGINE_PREFIX + shell_join(job.argv()))
    return "\n".join(lines) + "\n"


def submit_local(job: ServeJob, record: dict, artifact: Path) -> tuple[str, callable]:
    """Run the rendered launch.sh (it execs the server: the pid stays the server's) in a session of its own (it
    outlives this command; `jobs cancel` stops it), output in logs/<name>/server.log. Returns the base URL and a
    liveness check."""
    log = open(job.logs / SERVER_LOG, "ab")
    proc = subprocess.Popen(["bash", str(artifact)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=job.logs)
    log.close()
    write_record(job.logs, {**record, "job_id": f"local-{proc.pid}", "pid": proc.pid, "state": "RUNNING"})

    def alive() -> str | None:
        return None if proc.poll() is None else f"the server exited with {proc.returncode}"
    return f"http://{job.host}:{job.port}", alive


# -- Slurm: an sbatch script that starts the server and waits for its health itself ---------------------------------

def render_slurm(job: ServeJob, time_limit: str | None, partition: str | None) -> str:
    from llmcluster.launch.slurm import FREE_PORT

    logs, py = str(job.logs), job.engine.python
    head = ["#!/bin/bash", f"# llmcluster serve start: {comment_text(job.served)} as job {comment_text(job.name)}",
            f"#SBATCH --job-name={directive_value(job.name, 'job name')}", "#SBATCH --nodes=1", "#SBATCH --ntasks=1",
            f"#SBATCH --output={directive_path(logs, 'log directory')}/slurm-%j.out"]
    if not job.engine.cpu:
        head.append(f"#SBATCH --gpus-per-node={job.sizing.tp}")
    if time_limit is not None:   # an empty one is refused by directive_value, not dropped
        head.append(f"#SBATCH --time={directive_value(time_limit, '--time')}")
    if partition is not None:
        head.append(f"#SBATCH --partition={directive_value(partition, '--partition')}")
    head += ["", "set -uo pipefail", "umask 027"]
    head += start_checks(job)
    head += env_lines(job, "{ echo \"[llmcluster] cannot read the API key file\" >&2; exit 1; }")
    # the port is the batch shell's $port, found free on the node at run time
    server = shell_join(job.argv(host="0.0.0.0", port=ShellVar("$port")))
    body = [
        "# the node's address as Slurm knows it (a node name need not resolve), a port free on it",
        'addr=$(scontrol show node -o "$SLURMD_NODENAME" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
        'addr=${addr:-$(hostname)}',
        f'port=$({shell_word(py)} -c {shell_word(FREE_PORT)} {job.port})',
        f"{eng.ENGINE_PREFIX}{server} &",
        "server=$!",
        "trap 'kill -TERM \"$server\" 2>/dev/null' TERM INT",
        'url="http://$addr:$port"',
        'echo "[llmcluster] job $SLURM_JOB_ID: vLLM starting at $url"',
        "# healthy: the URL goes to the endpoint file `serve start` (and `jobs status`) reads",
        "while kill -0 \"$server\" 2>/dev/null; do",
        f'  if {shell_word(py)} -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)" "$url/health" '
        "2>/dev/null; then",
        f'    echo "$url" > {shell_word(logs)}/.endpoint-"$SLURM_JOB_ID" && '
        f'mv {shell_word(logs)}/.endpoint-"$SLURM_JOB_ID" {shell_word(logs)}/endpoint-"$SLURM_JOB_ID"',
        '    echo "[llmcluster] healthy: $url/v1"; break',
        "  fi",
        "  sleep 2",
        "done",
        'wait "$server"; rc=$?',
        '[ "$rc" -gt 128 ] && kill -0 "$server" 2>/dev/null && wait "$server"',
        'echo "[llmcluster] vLLM exited with $rc"',
        'exit "$rc"',
    ]
    return "\n".join(head + body) + "\n"


def submit_slurm(job: ServeJob, record: dict, artifact: Path) -> tuple[str | None, callable]:
    from llmcluster.launch import slurm

    job_id = slurm.submit(str(artifact))
    write_record(job.logs, {**record, "job_id": job_id, "state": "SUBMITTED"})
    print(f"submitted {job.name} as Slurm job {job_id}; log: {job.logs}/slurm-{job_id}.out", file=sys.stderr)
    endpoint = job.logs / ENDPOINT.format(job=job_id)

    def alive() -> str | None:
        st = slurm.state(job_id)["state"]
        return None if st in ACTIVE_STATES or st == "UNKNOWN" else f"Slurm job {job_id} is {st}"

    def url() -> str | None:
        try:
            return endpoint.read_text().strip() or None
        except OSError:
            return None
    return url, alive


# -- waiting, then one request ------------------------------------------------------------------------------------

def _get(url: str, timeout: float = 5) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def wait_healthy(base, alive, timeout: float, name: str) -> str:
    """Poll until `base` (a URL, or a callable giving it once known) answers /health 200; a progress line every
    PROGRESS_S seconds. The job is left running on a timeout (its log says why it is slow)."""
    t0 = last = time.monotonic()
    while True:
        url = base() if callable(base) else base
        if url:
            try:
                if _get(f"{url}/health") == 200:
                    print(f"healthy after {time.monotonic() - t0:.0f} s", file=sys.stderr)
                    return url
            except (urllib.error.URLError, OSError):
                pass
        dead = alive()
        if dead:
            raise RunFailure(f"{name}: {dead} before /health answered; see `llmcluster jobs logs {name}`")
        now = time.monotonic()
        if now - t0 > timeout:
            raise RunFailure(f"{name}: no /health 200 after {timeout:.0f} s; the job is left running "
                             f"(`llmcluster jobs logs {name}`, `llmcluster jobs cancel {name}`)")
        if now - last >= PROGRESS_S:
            last = now
            print(f"waiting for {url or 'the job to start'}/health ({now - t0:.0f} s)", file=sys.stderr, flush=True)
        time.sleep(1)


def smoke(url: str, model: str, name: str, key: str | None = None) -> str:
    """One greedy token: the engine compiles and runs the model at the first request, not at start-up."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json", **auth.headers(key)})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]["text"]
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError) as e:
        detail = e.read().decode(errors="replace")[:200] if isinstance(e, urllib.error.HTTPError) else e
        raise RunFailure(f"{name}: healthy, but a one-token completion failed ({detail}); "
                         f"see `llmcluster jobs logs {name}`") from None


def curl_line(url: str, model: str, key_file: Path | None = None) -> str:
    """A request to copy: the key is read from its file by the shell that runs it (never printed)."""
    body = json.dumps({"model": model, "prompt": "def main(", "max_tokens": 32, "temperature": 0})
    bearer = f' -H "Authorization: Bearer $(cat {shell_word(key_file)})"' if key_file else ""
    return (f"curl -s {shell_word(url + '/v1/completions')} -H 'Content-Type: application/json'{bearer} "
            f"-d {shell_word(body)}")


# -- the command --------------------------------------------------------------------------------------------------

def start(job: ServeJob, *, dry_run: bool, timeout: float, time_limit: str | None = None,
          partition: str | None = None, k8s=None) -> int:
    if job.scheduler == "local":
        text = render_local(job)
    elif job.scheduler == "slurm":
        text = render_slurm(job, time_limit, partition)
    else:
        from llmcluster.serve.k8s import render
        text = render(k8s)
    if dry_run:
        sys.stdout.write(text)
        return 0
    old = read_record(job.logs)
    if old and old.get("job_id"):
        try:
            st = get(old["scheduler"]).state(job.logs, {**old, "run": job.name})["state"]
        except UserError:
            st = "?"
        if st in ACTIVE_STATES:
            raise UserError(f"{job.name} is already {st} ({old['scheduler']} job {old['job_id']}): "
                            f"`llmcluster jobs cancel {job.name}` it first, or give another --name")
    os.umask(UMASK)
    make_launch_dir(job.launch_dir, f"start of {job.name}")
    artifact = job.launch_dir / get(job.scheduler).artifact
    write_once(artifact, text, 0o400)
    if job.auth and job.scheduler != "k8s":       # the guard the script imports (k8s: its ConfigMap)
        write_once(job.launch_dir / auth.GUARD_FILE, auth.guard_source(), 0o400)
    key = auth.new_key() if job.auth else None
    if key:     # a fresh key per start, in the file the rendered script (or the Secret) hands vLLM
        auth.write_key(job.logs, key)
    record = {"run": job.name, "kind": "serve", "scheduler": job.scheduler, "launch": job.launch_id,
              "artifact": str(artifact), "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nodes": 1,
              "procs_per_node": job.sizing.tp, "world_size": job.sizing.tp, "model": job.served,
              "model_dir": str(job.target.directory), "port": job.port, "engine": job.engine.python,
              "slo_ttft_p99_ms": job.slo_ttft_p99_ms, "auth": job.auth}
    if job.target.adapter is not None:
        record["adapter"] = str(job.target.adapter)
    record.update(job.lineage or {})
    if job.scheduler == "k8s":
        from llmcluster.serve.k8s import submit

        url = submit(k8s, record, lambda r: write_record(job.logs, r), timeout, key)
        write_record(job.logs, {**(read_record(job.logs) or record), "endpoint": f"{url}/v1"})
        # the Service's name resolves inside the cluster only: from a login node, the readiness probe is the check
        try:
            socket.getaddrinfo(url.split("//")[1].split(":")[0], None)
        except OSError:
            print("ready (/health); the smoke request needs the cluster's DNS: send the curl below from a pod",
                  file=sys.stderr)
        else:
            smoke(url, job.served, job.name, key)
    else:
        base, alive = (submit_local(job, record, artifact) if job.scheduler == "local"
                       else submit_slurm(job, record, artifact))
        url = wait_healthy(base, alive, timeout, job.name)
        write_record(job.logs, {**(read_record(job.logs) or record), "endpoint": f"{url}/v1"})
        smoke(url, job.served, job.name, key)
    print(f"endpoint {url}/v1")
    print(curl_line(url, job.served, job.key_file))
    return 0


def build(args, cfg, root: Path):
    """The job (and for Kubernetes its objects) from the parsed flags, the config's serve and job sections and the
    cluster spec: every check before anything is written."""
    from llmcluster.config.cluster_load import load_cluster
    from llmcluster.storage.layout import check_run_name

    # before anything is launched: a server on a port that cannot exist, or a wait that ends before it begins,
    # would be left running (or LOST) by a start that reports failure
    if args.port is not None and not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: expected 1..65535")
    if not 0 < args.timeout < float("inf"):
        raise UserError(f"--timeout {args.timeout:g}: expected a positive number of seconds")
    host = args.host or ("127.0.0.1" if args.scheduler == "local" else "0.0.0.0")
    if args.scheduler == "local" and args.port is not None:   # elsewhere the port is the node's, found at run time
        from llmcluster.monitor.listen import check_can_listen

        check_can_listen(host, args.port)   # else a server already there would answer /health for ours
    cluster = load_cluster(args.cluster).spec
    target = eng.resolve_target(args.model, args.root, cfg.run.storage)
    if args.scheduler == "k8s":   # the image's python, not one on this host
        engine = eng.Engine("python3", args.image.rsplit(":", 1)[-1], cpu=False)
    else:
        engine = eng.find_engine(args.engine_python)
    sizing = eng.size(target, cluster, cfg.serve, engine)
    problems = eng.refusals(target, engine, sizing)
    if problems:
        raise UserError(f"{target.directory}: " + "; ".join(problems))
    from llmcluster.export.lineage import served

    lineage = served(target.export, getattr(args, "require_lineage", False))   # before anything is written
    name = check_run_name(args.name or f"serve-{target.name}")
    line_text(str(root), "storage root")
    port = args.port or (free_port(host) if args.scheduler == "local" else 8000)
    job = ServeJob(name, args.scheduler, root, engine, target, sizing, host, port,
                   next_launch_id(root / "logs" / name), cfg.serve.slo.ttft_p99_ms, auth=not args.no_auth,
                   lineage=lineage)
    k8s = None
    if args.scheduler == "k8s":
        from llmcluster.launch.cluster_defaults import job_with_cluster_defaults
        from llmcluster.serve.k8s import Serving

        k8s = Serving.build(job, job_with_cluster_defaults(cfg.job, cluster, "k8s"), args.image, args.namespace,
                            args.prometheus_namespace)
    for line in engine_warnings(target.model, engine.cpu):    # after every refusal: bad input stays one line
        print(f"warning: {line}", file=sys.stderr)
    if args.no_auth:
        print(f"warning: --no-auth: {name} answers anyone who can reach {host}:{port}, without a key",
              file=sys.stderr)
    return job, k8s
