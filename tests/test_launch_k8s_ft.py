"""Kubernetes with ft for 3 replica groups (issue 54): rendered offline and checked strictly (as test_launch_k8s.py
does), every group's metrics ports declared in its pods, admitted by the NetworkPolicy and named for the scrape;
`launch --apply` reads the cluster's JobSet CRD and refuses one without the RestartJob failure-policy action
(the shipped CRD in tests/data, and a copy without it, served by test_launch_k8s.py's recording server)."""

from __future__ import annotations

import copy
import json

import pytest
from test_launch_k8s import CRD_DIR, IMAGE, Recorder, fake_apiserver, pod_templates, render, validate_all  # noqa: F401

from conftest import assert_one_line_error, run_cli

METRICS = 9400
FT3 = ("--nodes", "3", "--set", "ft.enabled=true", "--set", "parallel.dp_replicate=3",
       "--set", f"log.metrics_bind=0.0.0.0:{METRICS}")
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jobsets.jobset.x-k8s.io"


def group_pods(objects: list[dict]) -> dict[int, dict]:
    js = objects[-1]
    assert js["kind"] == "JobSet"
    return {int(rj["name"].split("-")[1]): rj["template"]["spec"]["template"] for rj in js["spec"]["replicatedJobs"]}


def test_three_groups_render_strictly_hardened_with_every_groups_metrics_ports_declared_admitted_scraped(
        tmp_path, monkeypatch):
    from llmcluster.config.schema import JobConfig
    from llmcluster.launch.k8s.pod import METRICS_PORT
    from llmcluster.ft.group import port_slot

    objects = render(tmp_path, "jobset", *FT3)
    validate_all(objects)                    # core schemas and the JobSet CRD, unknown fields refused
    assert [o["kind"] for o in objects] == ["ConfigMap", "NetworkPolicy", "Deployment", "Service", "JobSet"]
    netpol, js = objects[1], objects[-1]
    assert js["spec"]["failurePolicy"]["rules"][0]["action"] == "RestartJob"
    admitted = [r["ports"][0] for r in netpol["spec"]["ingress"] if "ports" in r]
    assert len(admitted) == 1 and admitted[0]["protocol"] == "TCP"
    opened = range(admitted[0]["port"], admitted[0]["endPort"] + 1)
    cfg = JobConfig.model_validate({"ft": {"enabled": True}})
    pods = group_pods(objects)
    assert sorted(pods) == [0, 1, 2]
    procs = None
    for g, tpl in pods.items():
        c = tpl["spec"]["containers"][0]
        argv = c["args"]
        procs = int(argv[argv.index("--nproc-per-node") + 1])
        ports = [p for p in c["ports"] if p.get("name") != "rdzv"]
        # the ports the group's ranks serve on (ft/group.py's port_slot, LLMCLUSTER_FT_GROUP = g) are declared
        monkeypatch.setenv("LLMCLUSTER_FT_GROUP", str(g))
        monkeypatch.setenv("LLMCLUSTER_FT_GROUPS", "3")
        serve = [METRICS + port_slot(cfg, r, procs) for r in range(procs)]
        assert [p["containerPort"] for p in ports] == serve, (g, ports)
        assert ports[0].get("name") == METRICS_PORT     # the one `monitor config --kubernetes`'s PodMonitor scrapes
        assert all(p in opened for p in serve), (g, serve, opened)
        # hardened as every form's pods (test_launch_k8s.py)
        spec = tpl["spec"]
        assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                        "privileged": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True}
        env = {e["name"]: e for e in c["env"]}
        assert env["LLMCLUSTER_FT_GROUP"]["value"] == str(g) and "valueFrom" in env["LLMCLUSTER_FT_SECRET"]
    assert procs and len(opened) == 3 * procs
    assert all(p["spec"]["automountServiceAccountToken"] is False for p in pod_templates(objects[2]))


def jobset_crd(without_restart_job: bool = False) -> dict:
    """The shipped JobSet CRD's schema (tests/data) as the API server serves the CRD object."""
    schema = json.loads((CRD_DIR / "jobset.v1alpha2.schema.json").read_text())
    if without_restart_job:
        schema = copy.deepcopy(schema)
        action = schema["properties"]["spec"]["properties"]["failurePolicy"]["properties"]["rules"]["items"][
            "properties"]["action"]
        action["enum"] = [a for a in action["enum"] if a not in ("RestartJob", "RestartJobAndIgnoreMaxRestarts")]
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "jobsets.jobset.x-k8s.io"},
            "spec": {"group": "jobset.x-k8s.io", "scope": "Namespaced",
                     "names": {"kind": "JobSet", "plural": "jobsets"},
                     "versions": [{"name": "v1alpha2", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": schema}}]}}


def apply_ft(tmp_path, env):
    return run_cli("launch", "--scheduler", "k8s", "--k8s-kind", "jobset", "--image", IMAGE, "--root",
                   tmp_path / "s", *FT3, "--apply", env=env)


def test_apply_reads_the_jobset_crd_and_creates_the_run_when_it_has_restart_job(tmp_path, fake_apiserver):
    Recorder.objects[CRD_PATH] = jobset_crd()
    p = apply_ft(tmp_path, fake_apiserver)
    assert p.returncode == 0, p.stderr
    calls = [(verb, path.split("?")[0]) for verb, path, _ in Recorder.calls]
    assert calls[0] == ("GET", CRD_PATH)               # read before anything is created
    assert ("POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets") in calls


@pytest.mark.parametrize("served", ["without RestartJob", "absent"])
def test_apply_refuses_a_jobset_crd_without_restart_job_in_one_line_creating_nothing(tmp_path, fake_apiserver,
                                                                                      served):
    if served != "absent":
        Recorder.objects[CRD_PATH] = jobset_crd(without_restart_job=True)
    p = apply_ft(tmp_path, fake_apiserver)
    if served == "absent":
        assert_one_line_error(p, "needs JobSet", "jobsets.jobset.x-k8s.io", "404")
    else:
        assert_one_line_error(p, "JobSet CRD", "RestartJob", "FailJobSet, RestartJobSet")
    assert not [c for c in Recorder.calls if c[0] == "POST"], Recorder.calls
