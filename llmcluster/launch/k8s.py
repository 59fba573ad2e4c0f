"""Kubernetes: render a LaunchSpec as (a) an Indexed batch/v1 Job + headless Service, (b) a Volcano Job,
(c) a JobSet or (d) a Kubeflow PyTorchJob, and create / query / delete them with the official client.

Pods are built from the `kubernetes` client models (typed: a wrong field is an error here, not on the API
server); the CRD kinds wrap them in plain dicts. Every form runs one torchrun agent per pod (= node) with a
c10d rendezvous at the first pod's DNS name, mounts the storage claim with datasets/ read-only and
checkpoints/, logs/, models/ read-write, a memory-backed /dev/shm, and runs as non-root without privilege.
The resolved job config travels in a ConfigMap mounted at /etc/llmcluster.
"""

from __future__ import annotations

from llmcluster.launch.spec import LaunchSpec

CONFIG_DIR = "/etc/llmcluster"
RUN_LABEL = "llmcluster.io/run"
# (apiVersion, plural) of the custom resources
CRDS = {"Job": ("batch.volcano.sh/v1alpha1", "jobs"), "JobSet": ("jobset.x-k8s.io/v1alpha2", "jobsets"),
        "PyTorchJob": ("kubeflow.org/v1", "pytorchjobs")}


def _client():
    try:
        from kubernetes import client
    except ImportError:
        from llmcluster.errors import UserError
        raise UserError("--scheduler k8s needs the kubernetes client: pip install 'llmcluster[k8s]'") from None
    return client


def _quantity(slurm_mem: str) -> str:
    """Slurm memory (480G = 480 GiB, a bare number = MiB) as a Kubernetes quantity."""
    unit = slurm_mem[-1]
    return slurm_mem[:-1] + unit + "i" if unit in "KMGT" else slurm_mem + "Mi"


def _to_dict(model) -> dict:
    return _client().ApiClient().sanitize_for_serialization(model)


def pod_template(spec: LaunchSpec, rdzv_endpoint: str, container: str = "trainer",
                 restart: str = "Never", subdomain: str | None = None, node_rank: str | None = None):
    """The pod every form runs: one torchrun agent starting `procs` ranks."""
    c = _client()
    j, k = spec.job, spec.job.k8s
    rdzv = ["--nnodes", str(j.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
            "--rdzv-id", spec.run]
    if node_rank:                      # not needed by c10d, but keeps rank 0 on pod 0 for readable logs
        rdzv += ["--node-rank", node_rank]
    argv = spec.torchrun("python", rdzv, f"{k.storage_path}/logs/{spec.run}/ranks/$(POD_NAME)")
    env = {**j.environment(), "LLMCLUSTER_STORAGE": k.storage_path}
    if j.gpus_per_node == 0:
        env.setdefault("OMP_NUM_THREADS", "1")
    resources = {}
    if j.gpus_per_node:
        resources["nvidia.com/gpu"] = str(j.gpus_per_node)
    if j.cpus_per_node:
        resources["cpu"] = str(j.cpus_per_node)
    if j.mem_per_node:
        resources["memory"] = _quantity(j.mem_per_node)
    area = lambda name, ro: c.V1VolumeMount(name="storage", mount_path=f"{k.storage_path}/{name}",  # noqa: E731
                                            sub_path=name, read_only=ro)
    mounts = [area("datasets", True), area("checkpoints", False), area("logs", False), area("models", False),
              c.V1VolumeMount(name="config", mount_path=CONFIG_DIR, read_only=True),
              c.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    volumes = [c.V1Volume(name="storage", persistent_volume_claim=c.V1PersistentVolumeClaimVolumeSource(
                   claim_name=k.storage_claim)),
               c.V1Volume(name="config", config_map=c.V1ConfigMapVolumeSource(name=f"{spec.run}-config")),
               c.V1Volume(name="dshm", empty_dir=c.V1EmptyDirVolumeSource(medium="Memory",
                                                                           size_limit=k.shm_size))]
    for i, m in enumerate(j.mounts):
        volumes.append(c.V1Volume(name=f"mount{i}", host_path=c.V1HostPathVolumeSource(path=m.source)))
        mounts.append(c.V1VolumeMount(name=f"mount{i}", mount_path=m.path, read_only=m.read_only))
    trainer = c.V1Container(
        name=container, image=j.image, command=argv[:1], args=argv[1:], working_dir=k.storage_path,
        env=[c.V1EnvVar(name="POD_NAME", value_from=c.V1EnvVarSource(
            field_ref=c.V1ObjectFieldSelector(field_path="metadata.name")))]
            + [c.V1EnvVar(name=n, value=v) for n, v in env.items()],
        ports=[c.V1ContainerPort(container_port=k.rdzv_port, name="rdzv")],
        resources=c.V1ResourceRequirements(limits=resources or None, requests=resources or None),
        volume_mounts=mounts,
        security_context=c.V1SecurityContext(
            privileged=False, allow_privilege_escalation=False, run_as_non_root=True,
            capabilities=c.V1Capabilities(drop=["ALL"])))
    pod = c.V1PodSpec(
        containers=[trainer], volumes=volumes, restart_policy=restart, subdomain=subdomain,
        service_account_name=k.service_account,
        # the trainer checkpoints on SIGTERM: give it the same grace period Slurm gives
        termination_grace_period_seconds=j.signal_before_s,
        security_context=c.V1PodSecurityContext(
            run_as_non_root=True, run_as_user=k.run_as_user, run_as_group=k.run_as_user,
            fs_group=k.run_as_user, seccomp_profile=c.V1SeccompProfile(type="RuntimeDefault")))
    return c.V1PodTemplateSpec(metadata=c.V1ObjectMeta(labels={RUN_LABEL: spec.run}), spec=pod)


def _meta(spec: LaunchSpec, name: str | None = None) -> dict:
    return {"name": name or spec.run, "namespace": spec.job.k8s.namespace, "labels": {RUN_LABEL: spec.run}}


def config_map(spec: LaunchSpec) -> dict:
    c = _client()
    return _to_dict(c.V1ConfigMap(api_version="v1", kind="ConfigMap",
                                  metadata=c.V1ObjectMeta(**_meta(spec, f"{spec.run}-config")),
                                  data={"config.yaml": spec.config_yaml}))


def _indexed_job_spec(spec: LaunchSpec, rdzv: str, subdomain: str, backoff: int):
    """An Indexed Job of `nodes` pods; each pod's rank is its completion index."""
    c = _client()
    tpl = pod_template(spec, rdzv, subdomain=subdomain, node_rank="$(JOB_COMPLETION_INDEX)")
    return c.V1JobSpec(
        completion_mode="Indexed", completions=spec.job.nodes, parallelism=spec.job.nodes,
        backoff_limit=backoff, template=tpl,
        # an evicted / preempted pod does not count as a failure: it is simply run again
        pod_failure_policy=c.V1PodFailurePolicy(rules=[c.V1PodFailurePolicyRule(
            action="Ignore", on_pod_conditions=[c.V1PodFailurePolicyOnPodConditionsPattern(
                type="DisruptionTarget", status="True")])]))


def indexed_job(spec: LaunchSpec) -> list[dict]:
    c = _client()
    k = spec.job.k8s
    rdzv = f"{spec.run}-0.{spec.run}:{k.rdzv_port}"     # pod 0's DNS name through the headless Service
    service = c.V1Service(
        api_version="v1", kind="Service", metadata=c.V1ObjectMeta(**_meta(spec)),
        spec=c.V1ServiceSpec(cluster_ip="None", selector={"batch.kubernetes.io/job-name": spec.run},
                             publish_not_ready_addresses=True,   # rendezvous before pods are Ready
                             ports=[c.V1ServicePort(name="rdzv", port=k.rdzv_port)]))
    job = c.V1Job(api_version="batch/v1", kind="Job", metadata=c.V1ObjectMeta(**_meta(spec)),
                  spec=_indexed_job_spec(spec, rdzv, spec.run, backoff=spec.job.max_requeues * spec.job.nodes))
    return [config_map(spec), _to_dict(service), _to_dict(job)]


def volcano_job(spec: LaunchSpec) -> list[dict]:
    """Gang-scheduled: all pods start together or none (minAvailable); evicted -> the whole job restarts.
    The `pytorch` plugin sets MASTER_ADDR/MASTER_PORT to the master pod; `svc` gives pods DNS names."""
    j = spec.job
    tpl = _to_dict(pod_template(spec, "$(MASTER_ADDR):$(MASTER_PORT)"))
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
    return [config_map(spec), {"apiVersion": CRDS["Job"][0], "kind": "Job", "metadata": _meta(spec),
                               "spec": body}]


def jobset(spec: LaunchSpec) -> list[dict]:
    """One replicated Indexed Job; JobSet creates the headless Service (<run>) and restarts the whole set."""
    j = spec.job
    rdzv = f"{spec.run}-node-0-0.{spec.run}:{j.k8s.rdzv_port}"   # <jobset>-<replicatedJob>-<job>-<pod>
    job_spec = _to_dict(_indexed_job_spec(spec, rdzv, spec.run, backoff=0))
    job_spec["template"]["spec"].pop("subdomain")            # JobSet sets it from spec.network
    body = {"network": {"enableDNSHostnames": True, "subdomain": spec.run},
            "failurePolicy": {"maxRestarts": j.max_requeues},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job_spec}}]}
    meta = _meta(spec)
    if j.k8s.queue:
        meta["labels"]["kueue.x-k8s.io/queue-name"] = j.k8s.queue
    return [config_map(spec), {"apiVersion": CRDS["JobSet"][0], "kind": "JobSet", "metadata": meta,
                               "spec": body}]


def pytorchjob(spec: LaunchSpec) -> list[dict]:
    """Kubeflow's operator sets MASTER_ADDR/MASTER_PORT (the Master pod's service) and wants the container
    named `pytorch`."""
    j = spec.job
    tpl = _to_dict(pod_template(spec, "$(MASTER_ADDR):$(MASTER_PORT)", container="pytorch",
                                restart="OnFailure"))
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": tpl}}
    if j.nodes > 1:
        replicas["Worker"] = {"replicas": j.nodes - 1, "restartPolicy": "OnFailure", "template": tpl}
    body = {"runPolicy": {"backoffLimit": j.max_requeues, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": replicas}
    return [config_map(spec), {"apiVersion": CRDS["PyTorchJob"][0], "kind": "PyTorchJob",
                               "metadata": _meta(spec), "spec": body}]


FORMS = {"indexed-job": indexed_job, "volcano": volcano_job, "jobset": jobset, "pytorchjob": pytorchjob}


def render(spec: LaunchSpec) -> list[dict]:
    return FORMS[spec.job.k8s.kind](spec)


def to_yaml(objects: list[dict]) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value: str):   # the ConfigMap's config.yaml stays readable: a literal block
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False)


# -- the API server ----------------------------------------------------------------------------------

def _api():
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_incluster_config()
    except ConfigException:
        try:
            config.load_kube_config()
        except (ConfigException, OSError) as e:
            from llmcluster.errors import UserError
            raise UserError(f"no Kubernetes credentials (in-cluster or kubeconfig): {e}") from None
    return _client()


def _call(fn, *args, **kw):
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    from llmcluster.errors import UserError
    try:
        return fn(*args, **kw)
    except ApiException as e:
        raise UserError(f"Kubernetes API: {fn.__name__}: {e.status} {e.reason}") from None
    except (HTTPError, OSError) as e:   # connection refused, DNS, TLS
        raise UserError(f"Kubernetes API unreachable: {e}") from None


def apply(objects: list[dict], namespace: str) -> None:
    c = _api()
    core, batch, custom = c.CoreV1Api(), c.BatchV1Api(), c.CustomObjectsApi()
    for o in objects:
        kind, version = o["kind"], o["apiVersion"]
        if kind == "ConfigMap":
            _call(core.create_namespaced_config_map, namespace, o)
        elif kind == "Service":
            _call(core.create_namespaced_service, namespace, o)
        elif kind == "Job" and version == "batch/v1":
            _call(batch.create_namespaced_job, namespace, o)
        else:
            group, ver = version.split("/")
            _call(custom.create_namespaced_custom_object, group, ver, namespace, CRDS[kind][1], o)


def _main_object(rec: dict) -> dict:
    return [o for o in rec["k8s"]["objects"] if o["kind"] not in ("ConfigMap", "Service")][0]


def state(rec: dict) -> dict:
    c = _api()
    ns, obj = rec["k8s"]["namespace"], _main_object(rec)
    if obj["apiVersion"] == "batch/v1":
        st = _call(c.BatchV1Api().read_namespaced_job_status, obj["name"], ns).status
        phase = ("SUCCEEDED" if (st.succeeded or 0) >= rec["nodes"] else "FAILED" if st.failed and not st.active
                 else "RUNNING" if st.active else "PENDING")
        return {"state": phase, "active": st.active or 0, "succeeded": st.succeeded or 0, "failed": st.failed or 0}
    group, ver = obj["apiVersion"].split("/")
    o = _call(c.CustomObjectsApi().get_namespaced_custom_object_status, group, ver, ns,
              CRDS[obj["kind"]][1], obj["name"])
    status = (o or {}).get("status") or {}
    if "state" in status:                                   # Volcano: status.state.phase
        return {"state": str(status["state"].get("phase", "UNKNOWN")).upper()}
    true = [cd["type"] for cd in status.get("conditions", []) if cd.get("status") == "True"]
    return {"state": true[-1].upper() if true else "PENDING"}


def logs(rec: dict, follow: bool) -> int:
    """The first pod's log (rank 0 under c10d with --node-rank, the master otherwise)."""
    c = _api()
    ns, core = rec["k8s"]["namespace"], c.CoreV1Api()
    pods = _call(core.list_namespaced_pod, ns, label_selector=f"{RUN_LABEL}={rec['run']}").items
    if not pods:
        from llmcluster.errors import UserError
        raise UserError(f"no pods for {rec['run']} in namespace {ns} yet")
    first = sorted(p.metadata.name for p in pods)[0]
    if follow:
        resp = _call(core.read_namespaced_pod_log, first, ns, follow=True, _preload_content=False)
        for chunk in resp.stream():
            print(chunk.decode(errors="replace"), end="", flush=True)
    else:
        print(_call(core.read_namespaced_pod_log, first, ns), end="")
    return 0


def cancel(rec: dict) -> None:
    c = _api()
    ns = rec["k8s"]["namespace"]
    core, batch, custom = c.CoreV1Api(), c.BatchV1Api(), c.CustomObjectsApi()
    body = c.V1DeleteOptions(propagation_policy="Foreground")   # pods go with their job
    # raw responses: servers answer a delete with a Status or with the object itself, depending on the kind
    raw = {"_preload_content": False}
    for o in reversed(rec["k8s"]["objects"]):
        if o["kind"] == "ConfigMap":
            _call(core.delete_namespaced_config_map, o["name"], ns, **raw)
        elif o["kind"] == "Service":
            _call(core.delete_namespaced_service, o["name"], ns, **raw)
        elif o["apiVersion"] == "batch/v1":
            _call(batch.delete_namespaced_job, o["name"], ns, body=body, **raw)
        else:
            group, ver = o["apiVersion"].split("/")
            _call(custom.delete_namespaced_custom_object, group, ver, ns, CRDS[o["kind"]][1], o["name"],
                  body=body, **raw)
