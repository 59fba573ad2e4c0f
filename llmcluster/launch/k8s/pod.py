"""The pod every Kubernetes form runs, and the objects around it (ConfigMap, NetworkPolicy).

One torchrun agent per pod (= node) starting `procs` ranks, hardened for a shared cluster:
  * no service-account token unless job.k8s.service_account is set (the trainer never calls the API);
  * a read-only root filesystem; /tmp and the compile caches (inductor, triton) are emptyDirs;
  * storage per area: datasets/ read-only, and only this run's checkpoints/<run>, logs/<run>, models/<run>
    (subPath mounts), each from its own claim (job.k8s.claims) or the shared job.k8s.storage_claim;
  * hostPath only under the prefixes the cluster allows (its scheduler.kubernetes.host_paths), always read-only;
  * fsGroupChangePolicy OnRootMismatch: the kubelet does not re-chown terabytes of checkpoints per start;
  * job.secret_env from a Secret (secretKeyRef): never in the rendered objects.
"""

from __future__ import annotations

import posixpath

from llmcluster.config.job import AREAS, Claim
from llmcluster.errors import UserError
from llmcluster.launch import ft_auth
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import K8sRef, k8s_text, line_text

CONFIG_DIR = "/etc/llmcluster"
RUN_LABEL = "llmcluster.io/run"
CACHE_DIR = "/cache"
METRICS_PORT = "train-metrics"   # the name `monitor config --kubernetes` scrapes (--train-port-name)
# writable scratch under a read-only root: Python, torch.compile and triton write here
CACHE_ENV = {"HOME": "/tmp", "XDG_CACHE_HOME": CACHE_DIR, "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_DIR}/inductor",
             "TRITON_CACHE_DIR": f"{CACHE_DIR}/triton"}


def client():
    try:
        from kubernetes import client as c
    except ImportError:
        raise UserError("--scheduler k8s needs the kubernetes client: pip install 'llmcluster[k8s]'") from None
    return c


def to_dict(model) -> dict:
    return client().ApiClient().sanitize_for_serialization(model)


def meta(spec: LaunchSpec, name: str | None = None) -> dict:
    return {"name": name or spec.run, "namespace": spec.job.k8s.namespace, "labels": {RUN_LABEL: spec.run}}


def _quantity(slurm_mem: str) -> str:
    """Slurm memory (480G = 480 GiB, a bare number = MiB) as a Kubernetes quantity."""
    unit = slurm_mem[-1]
    return slurm_mem[:-1] + unit + "i" if unit in "KMGT" else slurm_mem + "Mi"


def area_claims(spec: LaunchSpec) -> dict[str, tuple[Claim, str] | None]:
    """Per storage area: (its claim, the directory this pod mounts from it), or None (an emptyDir)."""
    k = spec.job.k8s
    out: dict[str, tuple[Claim, str] | None] = {}
    for area in AREAS:
        own = k.claims.get(area)
        claim = own or (Claim(claim=k.storage_claim) if k.storage_claim else None)
        if claim is None:
            if area in ("datasets", "checkpoints"):
                raise UserError(f"job.k8s: no claim for {area}/ (set job.k8s.claims.{area} or job.k8s.storage_claim)")
            out[area] = None       # logs/models of a run with nowhere to keep them: pod-local
            continue
        base = "" if own else area          # the area's own claim, or its directory on the shared one
        out[area] = (claim, posixpath.join(base, spec.run) if area != "datasets" else base)
    return out


def host_mounts(spec: LaunchSpec) -> list[tuple[str, str]]:
    """job.mounts as (source, path) hostPaths: refused unless under a prefix the cluster allows."""
    allowed = [p.rstrip("/") for p in spec.host_paths]
    for m in spec.job.mounts:
        src = m.source.rstrip("/")
        if not src or ".." in src.split("/") or not any(src == a or src.startswith(a + "/") for a in allowed):
            raise UserError(f"job.mounts source {m.source!r}: hostPath mounts are allowed only under the "
                            f"cluster spec's scheduler.kubernetes.host_paths ({', '.join(allowed) or 'none'})")
    return [(m.source, m.path) for m in spec.job.mounts]


# -- the hardening every pod of ours gets (training ranks here, vLLM servers in serve/k8s.py) -----------------------

def scratch_volumes(shm_size: str) -> tuple[list, list]:
    """(mounts, volumes): the writable scratch under a read-only root (HOME and /tmp, the caches of CACHE_ENV)
    and a memory-backed /dev/shm (dataloader workers, NCCL, vLLM's tensor-parallel workers), all emptyDirs."""
    c = client()
    mounts = [c.V1VolumeMount(name="dshm", mount_path="/dev/shm"), c.V1VolumeMount(name="tmp", mount_path="/tmp"),
              c.V1VolumeMount(name="cache", mount_path=CACHE_DIR)]
    volumes = [c.V1Volume(name="dshm", empty_dir=c.V1EmptyDirVolumeSource(medium="Memory", size_limit=shm_size)),
               c.V1Volume(name="tmp", empty_dir=c.V1EmptyDirVolumeSource()),
               c.V1Volume(name="cache", empty_dir=c.V1EmptyDirVolumeSource())]
    return mounts, volumes


def container_security():
    c = client()
    return c.V1SecurityContext(privileged=False, allow_privilege_escalation=False, run_as_non_root=True,
                               read_only_root_filesystem=True, capabilities=c.V1Capabilities(drop=["ALL"]))


def pod_security(uid: int):
    c = client()
    return c.V1PodSecurityContext(run_as_non_root=True, run_as_user=uid, run_as_group=uid, fs_group=uid,
                                  fs_group_change_policy="OnRootMismatch",
                                  seccomp_profile=c.V1SeccompProfile(type="RuntimeDefault"))


def tolerations(k) -> list | None:
    """job.k8s.tolerations as the client's models (None: none)."""
    c = client()
    return [c.V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                           effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"))
            for t in k.tolerations] or None


def metrics_ports(spec: LaunchSpec, group: int = 0) -> list[int]:
    """The ports a pod's ranks serve metrics on, one per local rank: log.metrics' port plus ft/group.py's
    port_slot, which with ft moves each replica group past the others' (group x procs: groups sharing a host
    keep apart), so a group's pod declares its own."""
    first = spec.metrics_port + (group * spec.job.procs if spec.ft else 0)
    return [first + i for i in range(spec.job.procs)]


def pod_template(spec: LaunchSpec, rdzv_endpoint: str, container: str = "trainer",
                 restart: str = "Never", subdomain: str | None = None, node_rank: str | None = None,
                 extra_env: dict[str, str] | None = None, group: int = 0):
    """The rank pod; `extra_env` adds variables of this pod's kind (an ft replica group's, `group`)."""
    c = client()
    j, k = spec.job, spec.job.k8s
    # the kubelet expands $(VAR) in command, args and env values: ours are K8sRefs, every other '$' is doubled
    log_dir = K8sRef(f"{k.storage_path}/logs/{spec.run}/ranks/$(POD_NAME)")   # both validated: no '$'
    argv = [k8s_text(a) for a in spec.torchrun("python", rdzv_endpoint, spec.run, log_dir, node_rank=node_rank)]
    env = {n: k8s_text(line_text(v, f"the environment value of {n}"))
           for n, v in {**spec.rank_env(), **CACHE_ENV, **(extra_env or {})}.items()}
    resources = {}
    if j.gpus_per_node:
        resources["nvidia.com/gpu"] = str(j.gpus_per_node)
    if j.cpus_per_node:
        resources["cpu"] = str(j.cpus_per_node)
    if j.mem_per_node:
        resources["memory"] = _quantity(j.mem_per_node)

    scratch_mounts, scratch = scratch_volumes(k.shm_size)
    mounts = [c.V1VolumeMount(name="config", mount_path=CONFIG_DIR, read_only=True), *scratch_mounts]
    volumes = [c.V1Volume(name="config", config_map=c.V1ConfigMapVolumeSource(name=f"{spec.run}-config")), *scratch]
    claim_volume: dict[tuple[str, bool], str] = {}
    for area, where in area_claims(spec).items():
        path = f"{k.storage_path}/{area}" + ("" if area == "datasets" else f"/{spec.run}")
        if where is None:
            volumes.append(c.V1Volume(name=f"local-{area}", empty_dir=c.V1EmptyDirVolumeSource()))
            mounts.append(c.V1VolumeMount(name=f"local-{area}", mount_path=path))
            continue
        claim, sub = where
        ro = claim.read_only or area == "datasets"       # training never writes its datasets
        key = (claim.claim, claim.read_only)
        if key not in claim_volume:
            claim_volume[key] = f"claim-{len(claim_volume)}"
            volumes.append(c.V1Volume(name=claim_volume[key],
                                      persistent_volume_claim=c.V1PersistentVolumeClaimVolumeSource(
                                          claim_name=claim.claim, read_only=claim.read_only or None)))
        mounts.append(c.V1VolumeMount(name=claim_volume[key], mount_path=path, sub_path=sub or None, read_only=ro))
    for i, (source, path) in enumerate(host_mounts(spec)):
        volumes.append(c.V1Volume(name=f"host-{i}", host_path=c.V1HostPathVolumeSource(path=source,
                                                                                      type="Directory")))
        mounts.append(c.V1VolumeMount(name=f"host-{i}", mount_path=path, read_only=True))

    env_vars = [c.V1EnvVar(name="POD_NAME", value_from=c.V1EnvVarSource(
                    field_ref=c.V1ObjectFieldSelector(field_path="metadata.name")))]
    env_vars += [c.V1EnvVar(name=n, value=v) for n, v in env.items()]
    env_vars += [c.V1EnvVar(name=n, value_from=c.V1EnvVarSource(secret_key_ref=c.V1SecretKeySelector(
                    name=k.secret_name, key=n))) for n in j.secret_env]
    if spec.ft:   # the run's ft secret (launch/ft_auth.py): a Secret `launch --apply` creates, named here, never held
        env_vars.append(c.V1EnvVar(name=ft_auth.VALUE_ENV, value_from=c.V1EnvVarSource(
            secret_key_ref=c.V1SecretKeySelector(name=ft_secret_name(spec.run), key=ft_auth.SECRET_FILE))))
    ports = [c.V1ContainerPort(container_port=k.rdzv_port, name="rdzv")]
    if spec.metrics_port:   # one per local rank; the first is named for `monitor config --kubernetes`
        ports += [c.V1ContainerPort(container_port=port, name=METRICS_PORT if i == 0 else None)
                  for i, port in enumerate(metrics_ports(spec, group))]
    trainer = c.V1Container(
        # Always: a moved tag is never run from a node's stale cache (with a digest it only re-checks)
        name=container, image=j.image, image_pull_policy="Always", command=argv[:1], args=argv[1:],
        working_dir=k.storage_path,
        env=env_vars, ports=ports,
        resources=c.V1ResourceRequirements(limits=resources or None, requests=resources or None),
        volume_mounts=mounts,
        security_context=container_security())
    pod = c.V1PodSpec(
        containers=[trainer], volumes=volumes, restart_policy=restart, subdomain=subdomain,
        service_account_name=k.service_account, automount_service_account_token=bool(k.service_account),
        node_selector=k.node_selector or None,
        tolerations=tolerations(k),
        # the trainer checkpoints on SIGTERM: give it the same grace period Slurm gives
        termination_grace_period_seconds=j.signal_before_s,
        security_context=pod_security(k.run_as_user))
    return c.V1PodTemplateSpec(metadata=c.V1ObjectMeta(labels={RUN_LABEL: spec.run}), spec=pod)


def config_map(spec: LaunchSpec) -> dict:
    c = client()
    return to_dict(c.V1ConfigMap(api_version="v1", kind="ConfigMap",
                                 metadata=c.V1ObjectMeta(**meta(spec, f"{spec.run}-config")),
                                 data={"config.yaml": spec.config_yaml}))


def network_policy(spec: LaunchSpec) -> dict:
    """c10d and gloo listen unauthenticated: only this run's own pods may reach them. The metrics ports,
    when there are some (every ft group's), are open to scrapers in any namespace; egress (storage, DNS, NCCL) is
    not limited."""
    c = client()
    me = c.V1LabelSelector(match_labels={RUN_LABEL: spec.run})
    rules = [c.V1NetworkPolicyIngressRule(_from=[c.V1NetworkPolicyPeer(pod_selector=me)])]
    if spec.metrics_port:
        rules.append(c.V1NetworkPolicyIngressRule(
            _from=[c.V1NetworkPolicyPeer(namespace_selector=c.V1LabelSelector())],
            ports=[c.V1NetworkPolicyPort(port=spec.metrics_port, protocol="TCP",
                                         end_port=metrics_ports(spec, max(spec.ft_groups - 1, 0))[-1])]))
    return to_dict(c.V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy", metadata=c.V1ObjectMeta(**meta(spec)),
        spec=c.V1NetworkPolicySpec(pod_selector=me, policy_types=["Ingress"], ingress=rules)))


def common(spec: LaunchSpec) -> list[dict]:
    """What every form creates besides its workload: the config and the run's network fence."""
    return [config_map(spec), network_policy(spec)]


def ft_secret_name(run: str) -> str:
    return f"{run}-ft-secret"


def ft_secret(spec) -> dict:
    """The run's ft secret as a Secret, made at submission (`launch --apply`): no rendered artefact holds it."""
    import secrets

    c = client()
    return to_dict(c.V1Secret(api_version="v1", kind="Secret", type="Opaque",
                              string_data={ft_auth.SECRET_FILE: secrets.token_hex(32)},
                              metadata=c.V1ObjectMeta(name=ft_secret_name(spec.run), namespace=spec.job.k8s.namespace,
                                                      labels=meta(spec)["labels"])))
