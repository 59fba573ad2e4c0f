"""Kubernetes: a LaunchSpec as (a) an Indexed batch/v1 Job + headless Service, (b) a Volcano Job, (c) a
JobSet or (d) a Kubeflow PyTorchJob (one module each), every one with a ConfigMap holding the resolved job
config (mounted at /etc/llmcluster) and a NetworkPolicy around the run's pods; created / queried /
deleted with the official client (api.py). The pod itself, and its hardening, is pod.py.

Pods are built from the `kubernetes` client models (typed: a wrong field is an error here, not on the API
server); the CRD kinds wrap them in plain dicts.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.launch.k8s import api, crd, indexed_job, jobset, pod, pytorchjob, volcano
from llmcluster.launch.k8s.pod import CONFIG_DIR, RUN_LABEL, area_claims, host_mounts  # noqa: F401
from llmcluster.launch.scheduler import Scheduler
from llmcluster.launch.spec import LaunchSpec
from llmcluster.render import yaml_text

FORMS = {"indexed-job": indexed_job, "volcano": volcano, "jobset": jobset, "pytorchjob": pytorchjob}
COMMON_KINDS = [("networking.k8s.io/v1", "NetworkPolicy", None), ("v1", "ConfigMap", None),
                ("v1", "Secret", None)]   # the Secret: an ft run's own (pod.ft_secret), labelled with the run
# the workload kinds of each form, deleted first on cancel
WORKLOAD = {"indexed-job": [("batch/v1", "Job", None), ("v1", "Service", None)],
            "volcano": [volcano.API], "pytorchjob": [pytorchjob.API],
            # with ft, the Lighthouse's Deployment and Service beside the JobSet
            "jobset": [jobset.API, ("apps/v1", "Deployment", None), ("v1", "Service", None)],
            # `serve start` (serve/k8s.py): a vLLM Deployment behind a Service
            "deployment": [("apps/v1", "Deployment", None), ("v1", "Service", None), ("v1", "Secret", None)]}
PLURALS = {m.API[1]: m.API[2] for m in (volcano, jobset, pytorchjob)}
# RFC 1123 names, as the API server checks them (apimachinery validation): labels for namespaces,
# Services and pod hostnames; subdomains for ConfigMaps, Secrets, claims, service accounts
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _dns(value: str, what: str, label: bool = True) -> None:
    regex, most = (DNS_LABEL, 63) if label else (DNS_SUBDOMAIN, 253)
    if not regex.fullmatch(value) or len(value) > most:
        raise UserError(f"{what} {value!r} is not a valid Kubernetes name (RFC 1123 "
                        f"{'label' if label else 'subdomain'}: lowercase letters, digits and '-', "
                        f"at most {most} characters)")


def check_names(spec: LaunchSpec) -> None:
    """Every name the API server would check, checked before anything is created (so an --apply never
    fails half-way on a name)."""
    k = spec.job.k8s
    _dns(spec.run, "run name")
    for name in [f"{spec.run}-config", *FORMS[k.kind].hostnames(spec)]:
        _dns(name, f"run name {spec.run!r} makes the name", label=True)
    _dns(k.namespace, "job.k8s.namespace")
    for name, what in [(k.secret_name, "job.k8s.secret_name"), (k.service_account, "job.k8s.service_account"),
                       (k.storage_claim, "job.k8s.storage_claim"),
                       *((c.claim, f"job.k8s.claims.{a}") for a, c in k.claims.items())]:
        if name is not None:
            _dns(name, what, label=False)


def objects(spec: LaunchSpec) -> list[dict]:
    return FORMS[spec.job.k8s.kind].objects(spec)


def to_yaml(objs: list[dict]) -> str:
    """The objects as YAML documents (render.yaml_text: the ConfigMap's config.yaml a literal block)."""
    return yaml_text(objs)


def _where(rec: dict) -> tuple[str, str]:
    """The form and namespace of a record, checked (job.json is a user-editable file)."""
    info = rec.get("k8s") or {}
    kind, ns = info.get("kind"), str(info.get("namespace", ""))
    if kind not in WORKLOAD:
        raise UserError(f"job.json of {rec.get('run')!r}: unknown Kubernetes form {kind!r}")
    _dns(ns, "job.json namespace")
    return kind, ns


class Kubernetes(Scheduler):
    name = "k8s"
    artifact = "job.yaml"
    in_container = True

    def check(self, spec: LaunchSpec) -> None:
        if not spec.job.image:
            raise UserError("--scheduler k8s needs a container image: --image or job.image")
        if spec.ft and spec.job.k8s.kind != "jobset":   # see k8s/ft.py: only a JobSet restarts one group alone
            raise UserError(f"ft.enabled with --k8s-kind {spec.job.k8s.kind}: a failed replica group must restart "
                            "alone, which only the JobSet form does here (--k8s-kind jobset)")
        check_names(spec)
        area_claims(spec)
        host_mounts(spec)

    def render(self, spec: LaunchSpec) -> str:
        return to_yaml(objects(spec))

    def submit(self, spec: LaunchSpec, artifact: Path, record: dict, write_record, apply: bool = False,
               **flags) -> int:
        objs = objects(spec)
        record["k8s"] = {"namespace": spec.job.k8s.namespace, "kind": spec.job.k8s.kind,
                         "objects": [{"apiVersion": o["apiVersion"], "kind": o["kind"],
                                      "name": o["metadata"]["name"]} for o in objs]}
        if not apply:
            write_record({**record, "job_id": None, "state": "RENDERED"})
            print(f"rendered {len(objs)} object(s) to {artifact} (add --apply to create them)")
            return 0
        if spec.ft:   # the JobSet controller must restart a group alone (k8s/crd.py): read its CRD first
            crd.check_jobset(crd.read_jobset(api.connect()))
        api.apply(([pod.ft_secret(spec)] if spec.ft else []) + objs, spec.job.k8s.namespace, PLURALS)
        write_record({**record, "job_id": spec.run, "state": "SUBMITTED"})
        print(f"created {', '.join(o['kind'] + '/' + o['metadata']['name'] for o in objs)} "
              f"in namespace {spec.job.k8s.namespace}")
        return 0

    def state(self, logs: Path, rec: dict) -> dict:
        if not rec.get("job_id"):
            return {"state": "RENDERED"}
        kind, ns = _where(rec)
        api_version, k, plural = WORKLOAD[kind][0]
        return api.state(api.connect(), api_version, k, plural, ns, rec["run"], int(rec.get("nodes") or 1))

    def logs(self, logs: Path, rec: dict, follow: bool) -> int:
        _, ns = _where(rec)
        return api.logs(rec["run"], ns, follow)

    def cancel(self, logs: Path, rec: dict) -> None:
        kind, ns = _where(rec)
        gone = api.cancel(rec["run"], ns, WORKLOAD[kind] + COMMON_KINDS)
        if not gone:
            raise UserError(f"no objects labelled {RUN_LABEL}={rec['run']} in namespace {ns}")
