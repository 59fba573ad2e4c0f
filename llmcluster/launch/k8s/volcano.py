"""Volcano: gang-scheduled (all pods start together or none: minAvailable); evicted -> the whole job
restarts. The `pytorch` plugin sets MASTER_ADDR/MASTER_PORT to the master pod; `svc` gives pods DNS names."""

from __future__ import annotations

from llmcluster.launch.k8s.pod import common, meta, pod_template, to_dict
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import K8sRef

API = ("batch.volcano.sh/v1alpha1", "Job", "jobs")


def hostnames(spec: LaunchSpec) -> list[str]:
    return [f"{spec.run}-master-0", f"{spec.run}-worker-{max(spec.job.nodes - 2, 0)}"]


def objects(spec: LaunchSpec) -> list[dict]:
    j = spec.job
    tpl = to_dict(pod_template(spec, K8sRef("$(MASTER_ADDR):$(MASTER_PORT)")))
    tasks = [{"name": "master", "replicas": 1, "template": tpl}]
    if j.nodes > 1:
        tasks.append({"name": "worker", "replicas": j.nodes - 1, "template": tpl})
    body = {"minAvailable": j.nodes, "schedulerName": "volcano", "maxRetry": max(j.max_requeues, 1),
            "plugins": {"pytorch": ["--master=master", "--worker=worker", f"--port={j.k8s.rdzv_port}"],
                        "svc": [], "env": []},
            "policies": [{"event": "PodEvicted", "action": "RestartJob"},
                         {"event": "PodFailed", "action": "RestartJob"}],
            "tasks": tasks}
    if j.k8s.queue:
        body["queue"] = j.k8s.queue
    return [*common(spec), {"apiVersion": API[0], "kind": API[1], "metadata": meta(spec), "spec": body}]
