"""The seed's form: an Indexed batch/v1 Job of `nodes` pods + a headless Service giving them DNS names;
each pod's node rank is its completion index, the rendezvous is pod 0."""

from __future__ import annotations

from llmcluster.launch.k8s.pod import client, common, meta, pod_template, to_dict
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import K8sRef


def job_spec(spec: LaunchSpec, rdzv: str, subdomain: str, backoff: int, completions: int | None = None,
             extra_env: dict[str, str] | None = None, group: int = 0):
    """`completions` pods (all the job's nodes, or an ft group's), each a torchrun agent of one world."""
    c = client()
    n = completions or spec.job.nodes
    tpl = pod_template(spec, rdzv, subdomain=subdomain, node_rank=K8sRef("$(JOB_COMPLETION_INDEX)"),
                       extra_env=extra_env, group=group)
    return c.V1JobSpec(
        completion_mode="Indexed", completions=n, parallelism=n,
        backoff_limit=backoff, template=tpl,
        # an evicted / preempted pod does not count as a failure: it is simply run again
        pod_failure_policy=c.V1PodFailurePolicy(rules=[c.V1PodFailurePolicyRule(
            action="Ignore", on_pod_conditions=[c.V1PodFailurePolicyOnPodConditionsPattern(
                type="DisruptionTarget", status="True")])]))


def hostnames(spec: LaunchSpec) -> list[str]:
    return [f"{spec.run}-{spec.job.nodes - 1}"]


def objects(spec: LaunchSpec) -> list[dict]:
    c = client()
    k = spec.job.k8s
    rdzv = f"{spec.run}-0.{spec.run}:{k.rdzv_port}"     # pod 0's DNS name through the headless Service
    service = c.V1Service(
        api_version="v1", kind="Service", metadata=c.V1ObjectMeta(**meta(spec)),
        spec=c.V1ServiceSpec(cluster_ip="None", selector={"batch.kubernetes.io/job-name": spec.run},
                             publish_not_ready_addresses=True,   # rendezvous before pods are Ready
                             ports=[c.V1ServicePort(name="rdzv", port=k.rdzv_port)]))
    job = c.V1Job(api_version="batch/v1", kind="Job", metadata=c.V1ObjectMeta(**meta(spec)),
                  spec=job_spec(spec, rdzv, spec.run, backoff=spec.job.max_requeues * spec.job.nodes))
    return [*common(spec), to_dict(service), to_dict(job)]
