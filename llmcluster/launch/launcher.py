"""`llmcluster launch`: render the spec for one scheduler, print it (--dry-run) or submit it, and record it.

Every launch writes its artifact (launch.sh / job.sbatch / job.yaml), the resolved config and a job.json
record under <storage>/logs/<run>/; `llmcluster jobs` works from those records.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.launch.spec import LaunchSpec

ARTIFACT = {"local": "launch.sh", "slurm": "job.sbatch", "k8s": "job.yaml"}
RECORD = "job.json"


def render(spec: LaunchSpec) -> str:
    if spec.scheduler == "local":
        from llmcluster.launch import local
        return local.render(spec)
    if spec.scheduler == "slurm":
        from llmcluster.launch import slurm
        return slurm.render(spec)
    from llmcluster.launch import k8s
    return k8s.to_yaml(k8s.render(spec))


def write_record(logs: Path, record: dict) -> None:
    tmp = logs / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, logs / RECORD)        # readers never see half a record


def read_record(logs: Path) -> dict | None:
    try:
        return json.loads((logs / RECORD).read_text())
    except (OSError, ValueError):
        return None


def launch(spec: LaunchSpec, *, dry_run: bool, apply: bool) -> int:
    text = render(spec)
    if dry_run:
        sys.stdout.write(text)            # exactly what would be submitted, and only that
        return 0
    logs = spec.logs
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {logs}: {e.strerror or e}") from None
    artifact = logs / ARTIFACT[spec.scheduler]
    artifact.write_text(text)
    spec.config_path.write_text(spec.config_yaml)
    record = {"run": spec.run, "scheduler": spec.scheduler, "artifact": str(artifact),
              "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "nodes": spec.job.nodes,
              "procs_per_node": spec.job.procs, "world_size": spec.job.world_size}
    old = read_record(logs)
    if old and old.get("job_id"):
        record["previous_job_ids"] = old.get("previous_job_ids", []) + [old["job_id"]]

    if spec.scheduler == "local":
        from llmcluster.launch import local

        def started(pid: int) -> None:
            write_record(logs, {**record, "job_id": f"local-{pid}", "pid": pid, "state": "RUNNING"})

        rc = local.run(spec, started)
        final = read_record(logs) or record
        write_record(logs, {**final, "state": "COMPLETED" if rc == 0 else "FAILED", "exit_code": rc})
        print(f"[llmcluster] run {spec.run} exited with {rc}; logs in {logs}", file=sys.stderr)
        return rc

    if spec.scheduler == "slurm":
        from llmcluster.launch import slurm
        artifact.chmod(0o755)
        job_id = slurm.submit(str(artifact))
        write_record(logs, {**record, "job_id": job_id})
        print(f"submitted {spec.run} as Slurm job {job_id}; log: {logs}/slurm-{job_id}.out")
        return 0

    from llmcluster.launch import k8s
    objects = k8s.render(spec)
    record["k8s"] = {"namespace": spec.job.k8s.namespace, "kind": spec.job.k8s.kind,
                     "objects": [{"apiVersion": o["apiVersion"], "kind": o["kind"],
                                  "name": o["metadata"]["name"]} for o in objects]}
    if not apply:
        write_record(logs, {**record, "job_id": None, "state": "RENDERED"})
        print(f"rendered {len(objects)} object(s) to {artifact} (add --apply to create them)")
        return 0
    k8s.apply(objects, spec.job.k8s.namespace)
    write_record(logs, {**record, "job_id": spec.run, "state": "SUBMITTED"})
    print(f"created {', '.join(o['kind'] + '/' + o['metadata']['name'] for o in objects)} "
          f"in namespace {spec.job.k8s.namespace}")
    return 0
