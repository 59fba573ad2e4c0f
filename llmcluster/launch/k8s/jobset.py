"""JobSet: one replicated Indexed Job; JobSet creates the headless Service (<run>) and restarts the whole
set on a failure, up to job.max_requeues times. With ft: one replicated Job per replica group (k8s/ft.py)."""

from __future__ import annotations

from llmcluster.launch.k8s import ft, indexed_job
from llmcluster.launch.k8s.pod import common, meta, to_dict
from llmcluster.launch.spec import LaunchSpec

API = ("jobset.x-k8s.io/v1alpha2", "JobSet", "jobsets")


def hostnames(spec: LaunchSpec) -> list[str]:
    if spec.ft:
        return ft.hostnames(spec)
    return [f"{spec.run}-node-0-{spec.job.nodes - 1}"]   # <jobset>-<replicatedJob>-<job>-<pod>


def objects(spec: LaunchSpec) -> list[dict]:
    if spec.ft:       # one replicated Job per replica group, restarted alone; the Lighthouse beside them
        return ft.objects(spec)
    j = spec.job
    rdzv = f"{spec.run}-node-0-0.{spec.run}:{j.k8s.rdzv_port}"
    job_spec = to_dict(indexed_job.job_spec(spec, rdzv, spec.run, backoff=0))
    job_spec["template"]["spec"].pop("subdomain")            # JobSet sets it from spec.network
    body = {"network": {"enableDNSHostnames": True, "subdomain": spec.run},
            "failurePolicy": {"maxRestarts": j.max_requeues},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job_spec}}]}
    m = meta(spec)
    if j.k8s.queue:
        m["labels"]["kueue.x-k8s.io/queue-name"] = j.k8s.queue
    return [*common(spec), {"apiVersion": API[0], "kind": API[1], "metadata": m, "spec": body}]
