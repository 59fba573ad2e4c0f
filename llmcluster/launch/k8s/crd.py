"""The JobSet CRD an ft run needs, read from the cluster before anything is created (`launch --apply`).

An ft run's JobSet restarts a failed replica group's Job alone with the failure-policy action `RestartJob`
(k8s/ft.py). Only recent JobSet releases have it (kubernetes-sigs/jobset KEP 262, the action added in 2026); an
older controller's CRD does not list it, and the API server would refuse the JobSet, or an older controller
restart every group. So `launch --apply` reads the installed CRD's schema and refuses in one line when the
action is not among `spec.failurePolicy.rules[].action`'s values.
"""

from __future__ import annotations

import json

from llmcluster.errors import UserError

JOBSET_CRD = "jobsets.jobset.x-k8s.io"
VERSION = "v1alpha2"          # the JobSet API version the forms render (k8s/jobset.py API)
NEEDED = "RestartJob"


def openapi_schema(crd: dict, version: str = VERSION) -> dict:
    """The openAPIV3Schema of `version` in a CustomResourceDefinition (or the schema itself, as tests/data
    ships them)."""
    if "versions" not in crd.get("spec", {}):
        return crd
    for v in crd["spec"]["versions"]:
        if v.get("name") == version:
            return (v.get("schema") or {}).get("openAPIV3Schema") or {}
    served = ", ".join(str(v.get("name")) for v in crd["spec"]["versions"])
    raise UserError(f"the cluster's JobSet CRD ({JOBSET_CRD}) does not serve {version} (it serves {served}): "
                    "ft needs a JobSet release with the failure-policy action RestartJob")


def failure_actions(schema: dict) -> list[str]:
    """The values spec.failurePolicy.rules[].action may take ([] when the schema has no such field)."""
    node = schema
    for key in ("spec", "failurePolicy", "rules"):
        node = (node.get("properties") or {}).get(key) or {}
    action = ((node.get("items") or {}).get("properties") or {}).get("action") or {}
    return [str(a) for a in action.get("enum") or []]


def check_jobset(crd: dict) -> None:
    """One UserError line unless the CRD's failure policy lists RestartJob."""
    actions = failure_actions(openapi_schema(crd))
    if NEEDED not in actions:
        raise UserError(f"ft.enabled: the cluster's JobSet CRD ({JOBSET_CRD}) has no failure-policy action "
                        f"{NEEDED} (its actions: {', '.join(actions) or 'none'}), so a failed replica group "
                        "cannot restart alone: upgrade JobSet to a release whose CRD lists it")


def read_jobset(c) -> dict:
    """The installed CRD as the API server has it (raw JSON: no client-side model in between)."""
    from llmcluster.launch.k8s.api import call

    try:
        resp = call(c.ApiextensionsV1Api().read_custom_resource_definition, JOBSET_CRD, _preload_content=False)
    except UserError as e:
        if ": 404 " not in str(e):
            raise
        raise UserError(f"ft.enabled needs JobSet on the cluster: it has no CRD {JOBSET_CRD} (404)") from None
    try:
        return json.loads(resp.data)
    except ValueError as e:
        raise UserError(f"Kubernetes API: the JobSet CRD ({JOBSET_CRD}) is not JSON: {e}") from None
