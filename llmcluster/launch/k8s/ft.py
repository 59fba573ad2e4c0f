"""Kubernetes with ft (per-step fault tolerance, issue 37): one JobSet, one replicated Job per replica group.

Each group `group-<g>` is an Indexed Job of `group_nodes` pods, a torchrun world of its own (rendezvous on its
pod 0). A pod that fails fails its Job (backoffLimit 0), and the JobSet's failurePolicy rule `RestartJob`
recreates that Job alone: the other groups keep running and keep committing steps in a smaller quorum, the
recreated group heals from a live peer. JobSet counts those restarts per Job against maxRestarts
(status.individualJobRecreates), job.max_requeues.

The Lighthouse is a Deployment (one hardened pod running `torchft_lighthouse`) behind a Service
`<run>-lighthouse`, unless ft.lighthouse names one already running. It carries the run's label, so the run's
NetworkPolicy fences it like the ranks: only the run's own pods reach it.
Volcano and PyTorchJob restart the whole job on a pod failure (their policies have no per-group restart), and
an Indexed Job is one group: with ft they are refused (Kubernetes.check).
"""

from __future__ import annotations

from llmcluster.launch.k8s import indexed_job
from llmcluster.launch.k8s.pod import (RUN_LABEL, client, common, container_security, meta, pod_security,
                                       scratch_volumes, to_dict, tolerations)
from llmcluster.launch.spec import LIGHTHOUSE, LIGHTHOUSE_PORT, LaunchSpec, lighthouse_argv
from llmcluster.render import k8s_text

ROLE_LABEL = "llmcluster.io/role"
GROUP_LABEL = "llmcluster.io/ft-group"
# the Lighthouse holds the quorum state of a few groups: small, fixed (requests = limits: Guaranteed QoS)
LIGHTHOUSE_RESOURCES = {"cpu": "1", "memory": "512Mi"}


def lighthouse_name(spec: LaunchSpec) -> str:
    return f"{spec.run}-lighthouse"


def group_name(g: int) -> str:
    return f"group-{g}"


def hostnames(spec: LaunchSpec) -> list[str]:
    """The longest names the JobSet makes (<jobset>-<replicatedJob>-<job>-<pod>), and the Lighthouse's."""
    return [f"{spec.run}-{group_name(spec.ft_groups - 1)}-0-{spec.group_nodes - 1}", lighthouse_name(spec)]


def lighthouse_url(spec: LaunchSpec) -> str:
    if spec.ft.lighthouse:
        return f"http://{spec.ft.lighthouse}"
    return f"http://{lighthouse_name(spec)}:{LIGHTHOUSE_PORT}"     # the Service, in the run's namespace


def jobset(spec: LaunchSpec) -> dict:
    from llmcluster.launch.k8s.jobset import API

    j = spec.job
    replicated = []
    for g in range(spec.ft_groups):
        name = group_name(g)
        rdzv = f"{spec.run}-{name}-0-0.{spec.run}:{j.k8s.rdzv_port}"    # the group's pod 0
        env = {"TORCHFT_LIGHTHOUSE": lighthouse_url(spec), "LLMCLUSTER_FT_GROUP": str(g),
               "LLMCLUSTER_FT_GROUPS": str(spec.ft_groups)}
        job_spec = to_dict(indexed_job.job_spec(spec, rdzv, spec.run, backoff=0, completions=spec.group_nodes,
                                                extra_env=env, group=g))
        job_spec["template"]["spec"].pop("subdomain")                  # JobSet sets it from spec.network
        job_spec["template"]["metadata"]["labels"][GROUP_LABEL] = str(g)
        replicated.append({"name": name, "replicas": 1, "template": {"spec": job_spec}})
    body = {"network": {"enableDNSHostnames": True, "subdomain": spec.run},
            # a failed group's Job is recreated alone; the others are not touched
            "failurePolicy": {"maxRestarts": j.max_requeues, "rules": [{
                "name": "restart-the-failed-group-alone", "action": "RestartJob",
                "targetReplicatedJobs": [r["name"] for r in replicated]}]},
            # invariant 4 (docs/fault-tolerance.md): a group's Job completes only when its group saw the run's
            # final step committed (it trained it, or found the end recorded), so the first one ends the JobSet and
            # the controller stops the rest: a frozen group does not hold the pods after the run ended
            "successPolicy": {"operator": "Any", "targetReplicatedJobs": [r["name"] for r in replicated]},
            "replicatedJobs": replicated}
    m = meta(spec)
    if j.k8s.queue:
        m["labels"]["kueue.x-k8s.io/queue-name"] = j.k8s.queue
    return {"apiVersion": API[0], "kind": API[1], "metadata": m, "spec": body}


def lighthouse(spec: LaunchSpec) -> list[dict]:
    """The Lighthouse Deployment and its Service, hardened like the rank pods (non-root, read-only root,
    no privilege escalation, no capabilities, no API token, fixed resources)."""
    c = client()
    j, k = spec.job, spec.job.k8s
    name = lighthouse_name(spec)
    labels = {RUN_LABEL: spec.run, ROLE_LABEL: "lighthouse"}
    argv = [k8s_text(a) for a in lighthouse_argv(LIGHTHOUSE, spec.ft, f"0.0.0.0:{LIGHTHOUSE_PORT}")]
    mounts, volumes = scratch_volumes(k.shm_size)
    container = c.V1Container(
        name="lighthouse", image=j.image, image_pull_policy="Always", command=argv[:1], args=argv[1:],
        ports=[c.V1ContainerPort(container_port=LIGHTHOUSE_PORT, name="lighthouse")],
        readiness_probe=c.V1Probe(tcp_socket=c.V1TCPSocketAction(port="lighthouse"), period_seconds=5),
        resources=c.V1ResourceRequirements(limits=LIGHTHOUSE_RESOURCES, requests=LIGHTHOUSE_RESOURCES),
        volume_mounts=mounts, security_context=container_security())
    pod = c.V1PodSpec(
        containers=[container], volumes=volumes, automount_service_account_token=False,
        node_selector=k.node_selector or None,
        tolerations=tolerations(k),
        security_context=pod_security(k.run_as_user))
    deployment = c.V1Deployment(
        api_version="apps/v1", kind="Deployment", metadata=c.V1ObjectMeta(**meta(spec, name)),
        spec=c.V1DeploymentSpec(
            replicas=1, selector=c.V1LabelSelector(match_labels=labels),
            # never two Lighthouses at once (two quorums): the old pod goes before a new one starts
            strategy=c.V1DeploymentStrategy(type="Recreate"),
            template=c.V1PodTemplateSpec(metadata=c.V1ObjectMeta(labels=labels), spec=pod)))
    service = c.V1Service(
        api_version="v1", kind="Service", metadata=c.V1ObjectMeta(**meta(spec, name)),
        spec=c.V1ServiceSpec(selector=labels, ports=[c.V1ServicePort(name="lighthouse", port=LIGHTHOUSE_PORT,
                                                                      target_port="lighthouse")]))
    return [to_dict(deployment), to_dict(service)]


def objects(spec: LaunchSpec) -> list[dict]:
    return [*common(spec), *([] if spec.ft.lighthouse else lighthouse(spec)), jobset(spec)]
