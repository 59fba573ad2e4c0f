"""The cluster spec as launch's defaults: what the job config and the flags do not say, the cluster does."""

from __future__ import annotations

from llmcluster.config.cluster import ClusterSpec
from llmcluster.config.job import JobSpec

# NCCL preset per fabric: RoCE runs over the same IB verbs transport as InfiniBand.
_NCCL = {"ib-hdr": "infiniband", "ib-ndr": "infiniband", "roce-200": "infiniband", "roce-400": "infiniband",
         "ethernet": "ethernet"}


def job_with_cluster_defaults(job: JobSpec, cluster: ClusterSpec, scheduler: str) -> JobSpec:
    """`job` with every value it leaves unset (pydantic's model_fields_set) taken from `cluster`.

    Called once, by the launch entry point, before the flags are applied (they override both)."""
    given, k_given = job.model_fields_set, job.k8s.model_fields_set
    h, slurm, kube = cluster.hardware, cluster.scheduler.slurm, cluster.scheduler.kubernetes
    image = slurm.image if scheduler == "slurm" else kube.image if scheduler == "k8s" else None
    top = {"gpus_per_node": h.gpus_per_node, "cpus_per_node": h.cpus_per_node, "partition": slurm.partition,
           "account": slurm.account, "image": image, "nccl": _NCCL.get(h.fabric)}
    k8s = {"namespace": kube.namespace, "kind": kube.kind, "queue": kube.queue,
           "service_account": kube.service_account, "node_selector": kube.node_selector,
           "tolerations": kube.tolerations,
           "claims": {a: c.model_dump() for a, c in cluster.storage.kubernetes.items()},
           "storage_path": cluster.storage.root if cluster.storage.root.startswith("/") else None}
    data = job.model_dump(exclude_unset=True)
    data.update({k: v for k, v in top.items() if k not in given and v is not None})
    data["k8s"] = {**job.k8s.model_dump(exclude_unset=True),
                   **{k: v for k, v in k8s.items() if k not in k_given and v not in (None, {}, [])}}
    return JobSpec.model_validate(data)
