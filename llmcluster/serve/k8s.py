"""`serve start --scheduler k8s`: vLLM as a Deployment behind a Service, created with the official client.

The pod is hardened as the training pods are (launch/k8s/pod.py: non-root, read-only root filesystem, no
capabilities, no service-account token, RuntimeDefault seccomp) with emptyDirs for HOME (/tmp), the caches and a
memory-backed /dev/shm; it mounts only the served export, read-only, from the models claim. Readiness and liveness
probe /health; a startup probe gives the engine its minutes of loading before liveness counts. The API key (issue 32)
is a Secret <name>-api-key that `serve start` creates with the key (the rendered objects name it, never hold it),
handed to vLLM as $VLLM_API_KEY; the guard that makes every route but /health, /ping, /metrics and /version need
it (serve/guard.py, vLLM's --middleware) is a ConfigMap <name>-guard mounted read-only on the pod's PYTHONPATH.
A NetworkPolicy opens the API port only, to the pods of the namespace labelled CLIENT_LABEL=true and to the
Prometheus namespace (it scrapes /metrics, which the guard leaves open).
`jobs status|logs|cancel` find the objects by their run label (launch/k8s).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from llmcluster.config.job import JobSpec
from llmcluster.errors import RunFailure, UserError
from llmcluster.launch.k8s import PLURALS, _dns, api, to_yaml
from llmcluster.launch.k8s.pod import (CACHE_DIR, CACHE_ENV, RUN_LABEL, client, container_security, pod_security,
                                       scratch_volumes, to_dict)
from llmcluster.monitor.serve_targets import SERVE_LABEL
from llmcluster.render import k8s_text
from llmcluster.serve import auth
from llmcluster.serve import engine as eng

PORT = 8000                      # vLLM's own default, in the pod
STARTUP_S = 1800                 # loading a 70B from a network volume takes minutes: liveness waits this long
# vLLM's caches (compiled graphs, the HF hub's) under the writable /cache emptyDir
SERVE_ENV = {**CACHE_ENV, "HF_HOME": f"{CACHE_DIR}/huggingface", "VLLM_CACHE_ROOT": f"{CACHE_DIR}/vllm"}
# the label a pod of the namespace carries to reach a served model (docs/security.md)
CLIENT_LABEL = "llmcluster.io/serve-client"
GUARD_DIR = "/opt/llmcluster/guard"     # the guard's ConfigMap, read-only, the pod's PYTHONPATH (serve/guard.py)


@dataclass(frozen=True)
class Serving:
    name: str
    namespace: str
    image: str
    argv: tuple[str, ...]
    claim: str                     # the PVC holding models/
    sub_path: str                  # the served export's directory on it
    mount: str                     # where the pod sees it (= --model)
    gpus: int
    cpus: int | None
    memory: str | None
    uid: int
    shm_size: str
    node_selector: dict
    tolerations: list
    auth: bool = True
    prometheus_namespace: str = "monitoring"

    @property
    def secret(self) -> str:
        return f"{self.name}-api-key"

    @property
    def guard(self) -> str:
        return f"{self.name}-guard"

    @classmethod
    def build(cls, job, spec: JobSpec, image: str, namespace: str | None,
              prometheus_namespace: str = "monitoring") -> Serving:
        """From a ServeJob (serve/start.py) and the job section with the cluster's defaults applied. Only an export
        under the storage root's models/ is on the models claim; the merged weights are served (a LoRA export's
        base directory is on no claim the pod mounts)."""
        k = spec.k8s
        ns = namespace or k.namespace
        _dns(job.name, "serving job name")
        _dns(ns, "namespace")
        _dns(prometheus_namespace, "--prometheus-namespace")
        models = (job.root / "models").resolve()
        export = job.target.export
        if export.parent != models:
            raise UserError(f"--model {export}: on Kubernetes the pod mounts the storage's models/ claim, and this "
                            f"export is not under {models} (`llmcluster export` writes there)")
        own = k.claims.get("models")
        claim = own.claim if own else k.storage_claim
        if claim is None:
            raise UserError("job.k8s: no claim for models/ (set job.k8s.claims.models or job.k8s.storage_claim)")
        sub = export.name if own else f"models/{export.name}"
        mount = f"{k.storage_path}/models/{export.name}"
        merged = eng.Target(job.target.model, export, job.target.name)
        argv = eng.argv(job.engine, merged, job.sizing, job.served, "0.0.0.0", PORT, guard=job.auth)
        argv[argv.index("--model") + 1] = mount
        return cls(job.name, ns, image, tuple(argv), claim, sub, mount, job.sizing.tp, spec.cpus_per_node,
                   spec.mem_per_node, k.run_as_user, k.shm_size, dict(k.node_selector), list(k.tolerations),
                   job.auth, prometheus_namespace)


def objects(s: Serving) -> list[dict]:
    from llmcluster.launch.k8s.pod import _quantity

    c = client()
    meta = {"name": s.name, "namespace": s.namespace, "labels": {RUN_LABEL: s.name}}
    mounts, volumes = scratch_volumes(s.shm_size)
    mounts.append(c.V1VolumeMount(name="model", mount_path=s.mount, sub_path=s.sub_path, read_only=True))
    volumes.append(c.V1Volume(name="model", persistent_volume_claim=c.V1PersistentVolumeClaimVolumeSource(
        claim_name=s.claim, read_only=True)))
    resources = {"nvidia.com/gpu": str(s.gpus)}
    if s.cpus:
        resources["cpu"] = str(s.cpus)
    if s.memory:
        resources["memory"] = _quantity(s.memory)
    env = {**SERVE_ENV, **eng.OFFLINE_ENV, **eng.LOOPBACK_ENV}
    if s.auth:     # the guard vLLM's --middleware imports: the ConfigMap's file, mounted read-only
        env["PYTHONPATH"] = GUARD_DIR
        mounts.append(c.V1VolumeMount(name="guard", mount_path=GUARD_DIR, read_only=True))
        volumes.append(c.V1Volume(name="guard", config_map=c.V1ConfigMapVolumeSource(name=s.guard,
                                                                                     default_mode=0o444)))

    def probe(period: int, failures: int):
        return c.V1Probe(http_get=c.V1HTTPGetAction(path="/health", port="http"), period_seconds=period,
                         timeout_seconds=5, failure_threshold=failures)
    server = c.V1Container(
        # the kubelet expands $(VAR) in command, args and env values: every '$' of ours doubled (render.k8s_text)
        name="vllm", image=s.image, image_pull_policy="Always", command=[k8s_text(a) for a in s.argv[:1]],
        args=[k8s_text(a) for a in s.argv[1:]],
        env=[c.V1EnvVar(name=n, value=k8s_text(v)) for n, v in env.items()] + ([c.V1EnvVar(
            name=auth.ENV, value_from=c.V1EnvVarSource(secret_key_ref=c.V1SecretKeySelector(
                name=s.secret, key=auth.SECRET_KEY)))] if s.auth else []),
        ports=[c.V1ContainerPort(container_port=PORT, name="http")],
        resources=c.V1ResourceRequirements(limits=resources, requests=resources),
        volume_mounts=mounts, security_context=container_security(),
        startup_probe=probe(10, STARTUP_S // 10), readiness_probe=probe(5, 3), liveness_probe=probe(10, 6))
    pod = c.V1PodSpec(
        containers=[server], volumes=volumes, automount_service_account_token=False,
        node_selector=s.node_selector or None,
        tolerations=[c.V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                                    effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"))
                     for t in s.tolerations] or None,
        security_context=pod_security(s.uid))
    labels = {RUN_LABEL: s.name}
    deployment = c.V1Deployment(
        api_version="apps/v1", kind="Deployment", metadata=c.V1ObjectMeta(**meta),
        spec=c.V1DeploymentSpec(
            replicas=1, selector=c.V1LabelSelector(match_labels=labels),
            # a new pod needs the GPUs the old one holds: replace, never surge
            strategy=c.V1DeploymentStrategy(type="Recreate"),
            # SERVE_LABEL: the PodMonitor `monitor config --kubernetes` writes scrapes these pods' /metrics
            template=c.V1PodTemplateSpec(metadata=c.V1ObjectMeta(labels={**labels, SERVE_LABEL: s.name}), spec=pod)))
    service = c.V1Service(api_version="v1", kind="Service", metadata=c.V1ObjectMeta(**meta), spec=c.V1ServiceSpec(
        selector=labels, ports=[c.V1ServicePort(name="http", port=PORT, target_port="http", protocol="TCP")]))
    # the API port is the pod's only way in, from the namespace's pods labelled as clients and from Prometheus
    peers = [c.V1NetworkPolicyPeer(pod_selector=c.V1LabelSelector(match_labels={CLIENT_LABEL: "true"})),
             c.V1NetworkPolicyPeer(namespace_selector=c.V1LabelSelector(
                 match_labels={"kubernetes.io/metadata.name": s.prometheus_namespace}))]
    policy = c.V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy", metadata=c.V1ObjectMeta(**meta),
        spec=c.V1NetworkPolicySpec(pod_selector=c.V1LabelSelector(match_labels=labels), policy_types=["Ingress"],
                                   ingress=[c.V1NetworkPolicyIngressRule(_from=peers, ports=[c.V1NetworkPolicyPort(
                                       port=PORT, protocol="TCP")])]))
    guard = [c.V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=c.V1ObjectMeta(**{**meta, "name": s.guard}),
                           data={auth.GUARD_FILE: auth.guard_source()})] if s.auth else []
    return [to_dict(o) for o in (*guard, policy, service, deployment)]


def render(s: Serving) -> str:
    return to_yaml(objects(s))


def endpoint(s: Serving) -> str:
    return f"http://{s.name}.{s.namespace}.svc:{PORT}"


def secret(s: Serving, key: str) -> dict:
    """The job's API key as a Secret: made here, at submission, so no rendered artefact holds it."""
    c = client()
    return to_dict(c.V1Secret(api_version="v1", kind="Secret", type="Opaque", string_data={auth.SECRET_KEY: key},
                              metadata=c.V1ObjectMeta(name=s.secret, namespace=s.namespace,
                                                      labels={RUN_LABEL: s.name})))


def submit(s: Serving, record: dict, write_record, timeout: float, key: str | None = None) -> str:
    """Create the objects (the key's Secret first; all or none), wait until the Deployment's pod passes its
    readiness probe (/health), and return the in-cluster base URL (requests from outside go through the API
    server's service proxy)."""
    objs = ([secret(s, key)] if s.auth and key else []) + objects(s)
    record = {**record, "k8s": {"namespace": s.namespace, "kind": "deployment",
                                "objects": [{"apiVersion": o["apiVersion"], "kind": o["kind"],
                                             "name": o["metadata"]["name"]} for o in objs]}}
    api.apply(objs, s.namespace, PLURALS)
    write_record({**record, "job_id": s.name, "state": "SUBMITTED"})
    print(f"created {', '.join(o['kind'] + '/' + o['metadata']['name'] for o in objs)} in namespace {s.namespace}",
          file=sys.stderr)
    c, t0 = api.connect(), time.monotonic()
    while api.state(c, "apps/v1", "Deployment", None, s.namespace, s.name, 1)["state"] != "RUNNING":
        if time.monotonic() - t0 > timeout:
            raise RunFailure(f"{s.name}: not ready (/health) after {timeout:.0f} s; the Deployment is left "
                             f"(`llmcluster jobs logs {s.name}`, `llmcluster jobs cancel {s.name}`)")
        time.sleep(5)
    return endpoint(s)

