"""The API server side of the Kubernetes forms: create (all or nothing), state, logs, cancel.

Objects are found again by their run label, not by the names in job.json (a user-editable file), and
only of the kinds the run's form creates.
"""

from __future__ import annotations

from llmcluster.errors import UserError
from llmcluster.launch.k8s.pod import RUN_LABEL, client

# (apiVersion, kind) of the built-in kinds -> (the typed API class, the method suffix)
BUILTIN = {("v1", "ConfigMap"): ("CoreV1Api", "config_map"), ("v1", "Service"): ("CoreV1Api", "service"),
           ("v1", "Secret"): ("CoreV1Api", "secret"),     # a serving job's API key (serve/k8s.py)
           ("networking.k8s.io/v1", "NetworkPolicy"): ("NetworkingV1Api", "network_policy"),
           ("batch/v1", "Job"): ("BatchV1Api", "job"), ("apps/v1", "Deployment"): ("AppsV1Api", "deployment")}


def connect():
    from kubernetes import config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_incluster_config()
    except ConfigException:
        try:
            config.load_kube_config()
        except (ConfigException, OSError) as e:
            raise UserError(f"no Kubernetes credentials (in-cluster or kubeconfig): {e}") from None
    return client()


def call(fn, *args, **kw):
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(*args, **kw)
    except ApiException as e:
        raise UserError(f"Kubernetes API: {fn.__name__}: {e.status} {e.reason}") from None
    except (HTTPError, OSError) as e:   # connection refused, DNS, TLS
        raise UserError(f"Kubernetes API unreachable: {e}") from None


class Kinds:
    """create / list / delete for one (apiVersion, kind, plural) against the connected client."""

    def __init__(self, c, api_version: str, kind: str, plural: str | None = None):
        self.c, self.api_version, self.kind, self.plural = c, api_version, kind, plural
        if (api_version, kind) in BUILTIN:
            cls, self.suffix = BUILTIN[(api_version, kind)]
            self.api = getattr(c, cls)()
        else:
            self.group, self.version = api_version.split("/")
            self.api, self.suffix = c.CustomObjectsApi(), None

    def create(self, ns: str, body: dict):
        if self.suffix:
            return call(getattr(self.api, f"create_namespaced_{self.suffix}"), ns, body)
        return call(self.api.create_namespaced_custom_object, self.group, self.version, ns, self.plural, body)

    def names(self, ns: str, selector: str) -> list[str]:
        if self.suffix:
            items = call(getattr(self.api, f"list_namespaced_{self.suffix}"), ns, label_selector=selector).items
            return [o.metadata.name for o in items]
        out = call(self.api.list_namespaced_custom_object, self.group, self.version, ns, self.plural,
                   label_selector=selector)
        return [o["metadata"]["name"] for o in (out or {}).get("items", [])]

    def delete(self, ns: str, name: str):
        # Foreground: pods go with their job. Raw responses: servers answer a delete with a Status or with
        # the object itself, depending on the kind
        body, raw = self.c.V1DeleteOptions(propagation_policy="Foreground"), {"_preload_content": False}
        if self.suffix:
            return call(getattr(self.api, f"delete_namespaced_{self.suffix}"), name, ns, body=body, **raw)
        return call(self.api.delete_namespaced_custom_object, self.group, self.version, ns, self.plural, name,
                    body=body, **raw)


def apply(objects: list[dict], namespace: str, plurals: dict[str, str]) -> None:
    """Create every object or none: a failure part-way deletes what this call created, then says so."""
    c = connect()
    created: list[tuple[Kinds, str]] = []
    for o in objects:
        kinds = Kinds(c, o["apiVersion"], o["kind"], plurals.get(o["kind"]))
        try:
            kinds.create(namespace, o)
        except UserError as err:
            undone = []
            for k, name in reversed(created):
                try:
                    k.delete(namespace, name)
                    undone.append(f"{k.kind}/{name}")
                except UserError:
                    pass
            raise UserError(f"{err} creating {o['kind']}/{o['metadata']['name']}; rolled back "
                            f"{', '.join(undone) or 'nothing (nothing was created)'}") from None
        created.append((kinds, o["metadata"]["name"]))


def state(c, api_version: str, kind: str, plural: str, namespace: str, name: str, nodes: int) -> dict:
    if api_version == "batch/v1":
        st = call(c.BatchV1Api().read_namespaced_job_status, name, namespace).status
        phase = ("SUCCEEDED" if (st.succeeded or 0) >= nodes else "FAILED" if st.failed and not st.active
                 else "RUNNING" if st.active else "PENDING")
        return {"state": phase, "active": st.active or 0, "succeeded": st.succeeded or 0, "failed": st.failed or 0}
    if api_version == "apps/v1":      # a serving Deployment: running once its replicas pass /health (readiness)
        st = call(c.AppsV1Api().read_namespaced_deployment_status, name, namespace).status
        ready = st.ready_replicas or 0
        return {"state": "RUNNING" if ready >= nodes else "PENDING", "ready": ready}
    group, ver = api_version.split("/")
    o = call(c.CustomObjectsApi().get_namespaced_custom_object_status, group, ver, namespace, plural, name)
    status = (o or {}).get("status") or {}
    if "state" in status:                                   # Volcano: status.state.phase
        return {"state": str(status["state"].get("phase", "UNKNOWN")).upper()}
    true = [cd["type"] for cd in status.get("conditions", []) if cd.get("status") == "True"]
    return {"state": true[-1].upper() if true else "PENDING"}


def logs(run: str, namespace: str, follow: bool) -> int:
    """The first pod's log (rank 0 under c10d with --node-rank, the master otherwise)."""
    c = connect()
    core = c.CoreV1Api()
    pods = call(core.list_namespaced_pod, namespace, label_selector=f"{RUN_LABEL}={run}").items
    if not pods:
        raise UserError(f"no pods for {run} in namespace {namespace} yet")
    first = sorted(p.metadata.name for p in pods)[0]
    if follow:
        resp = call(core.read_namespaced_pod_log, first, namespace, follow=True, _preload_content=False)
        for chunk in resp.stream():
            print(chunk.decode(errors="replace"), end="", flush=True)
    else:
        print(call(core.read_namespaced_pod_log, first, namespace), end="")
    return 0


def cancel(run: str, namespace: str, kinds: list[tuple[str, str, str | None]]) -> list[str]:
    """Delete every object of these kinds labelled with the run, workload first; returns what went."""
    c = connect()
    gone = []
    for api_version, kind, plural in kinds:
        k = Kinds(c, api_version, kind, plural)
        for name in k.names(namespace, f"{RUN_LABEL}={run}"):
            k.delete(namespace, name)
            gone.append(f"{kind}/{name}")
    return gone
