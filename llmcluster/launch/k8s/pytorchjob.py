"""Kubeflow PyTorchJob: the operator sets MASTER_ADDR/MASTER_PORT (the Master pod's service) and wants the
container named `pytorch`."""

from __future__ import annotations

from llmcluster.launch.k8s.pod import common, meta, pod_template, to_dict
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import K8sRef

API = ("kubeflow.org/v1", "PyTorchJob", "pytorchjobs")


def hostnames(spec: LaunchSpec) -> list[str]:
    return [f"{spec.run}-master-0", f"{spec.run}-worker-{max(spec.job.nodes - 2, 0)}"]


def objects(spec: LaunchSpec) -> list[dict]:
    j = spec.job
    tpl = to_dict(pod_template(spec, K8sRef("$(MASTER_ADDR):$(MASTER_PORT)"), container="pytorch",
                               restart="OnFailure"))
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": tpl}}
    if j.nodes > 1:
        replicas["Worker"] = {"replicas": j.nodes - 1, "restartPolicy": "OnFailure", "template": tpl}
    body = {"runPolicy": {"backoffLimit": j.max_requeues, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas}
    return [*common(spec), {"apiVersion": API[0], "kind": API[1], "metadata": meta(spec), "spec": body}]
