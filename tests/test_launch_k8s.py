"""Kubernetes forms: rendered offline and checked strictly; --apply/status/cancel against a recording server.

No API server can run here, so:
  * core objects (ConfigMap, Service, batch/v1 Job, and every pod template) go through
    `kubernetes-validate --strict` (the official OpenAPI schemas; unknown fields are errors);
  * the CRD kinds are checked with jsonschema against the upstream CRDs' openAPIV3Schema (tests/data),
    made strict the way the API server's strict field validation is: unknown properties are errors;
  * `--apply`, `jobs status` and `jobs cancel` talk to a small HTTP server on 127.0.0.1 that records the
    API calls and answers like the API server would for them (this is the one stand-in here).
"""

from __future__ import annotations

import copy
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO, assert_one_line_error, cli_env, run_cli

CRD_DIR = Path(__file__).parent / "data" / "k8s-crds"
CRD_SCHEMAS = {("batch.volcano.sh/v1alpha1", "Job"): "volcano-job.v1alpha1.schema.json",
               ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.v1alpha2.schema.json",
               ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.v1.schema.json"}
IMAGE = "nvcr.io/nvidia/pytorch:24.07-py3"
K8S_VERSION = "1.30.0"   # a version every current cluster serves; kubernetes-validate bundles its schemas


def strict(schema):
    """Unknown properties are errors (API server strict field validation), except where the CRD keeps them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


_SCHEMAS: dict = {}


def crd_validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key not in _SCHEMAS:
        schema = strict(json.loads((CRD_DIR / CRD_SCHEMAS[key]).read_text()))
        _SCHEMAS[key] = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(_SCHEMAS[key].iter_errors(obj))
    if error is not None:
        raise error


def pod_templates(obj: dict):
    """Every pod template inside an object (to validate them with the core schema as well)."""
    if isinstance(obj, dict):
        if "spec" in obj and isinstance(obj["spec"], dict) and "containers" in obj["spec"]:
            yield obj
        for v in obj.values():
            yield from pod_templates(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from pod_templates(v)


def validate_all(objects: list[dict]) -> None:
    for o in objects:
        if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS:
            crd_validate(o)
            for tpl in pod_templates(o["spec"]):
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": "t"}, "template": tpl}, K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)


_RENDERED: dict = {}


def render(tmp_path: Path, kind: str, *extra: str) -> list[dict]:
    """The CLI's --dry-run output (each form rendered once per test session; callers get a copy)."""
    key = (kind, extra)
    if key not in _RENDERED:
        _RENDERED[key] = _render(tmp_path, kind, *extra)
    return copy.deepcopy(_RENDERED[key])


def _render(tmp_path: Path, kind: str, *extra: str) -> list[dict]:
    p = run_cli("launch", "--scheduler", "k8s", "--k8s-kind", kind, "--nodes", "2", "--gpus-per-node", "4",
                "--image", IMAGE, "--root", tmp_path / "s", "--set", "job.cpus_per_node=32",
                "--set", "job.mem_per_node=480G", "--dry-run", *extra, check=True)
    assert not (tmp_path / "s").exists(), "--dry-run must not write anything"
    return list(yaml.safe_load_all(p.stdout))


FORMS = ["indexed-job", "volcano", "jobset", "pytorchjob"]


@pytest.mark.parametrize("kind", FORMS)
def test_every_form_validates_strictly_and_is_hardened(tmp_path, kind):
    objects = render(tmp_path, kind, "--set", "job.secret_env=[HF_TOKEN]")
    validate_all(objects)
    cm, netpol = objects[:2]
    assert cm["kind"] == "ConfigMap" and yaml.safe_load(cm["data"]["config.yaml"])["job"]["nodes"] == 2
    # c10d/gloo listen unauthenticated: only the run's own pods may connect
    assert netpol["kind"] == "NetworkPolicy" and netpol["spec"]["policyTypes"] == ["Ingress"]
    me = {"matchLabels": {"llmcluster.io/run": "llm-tiny"}}
    assert netpol["spec"]["podSelector"] == me and netpol["spec"]["ingress"] == [{"from": [{"podSelector": me}]}]
    pods = list(pod_templates(objects[2:]))
    assert pods
    for tpl in pods:
        spec = tpl["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "4", "cpu": "32", "memory": "480Gi"}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        # storage per area: datasets read-only; of checkpoints/logs/models only this run's directory
        assert mounts["/storage/datasets"]["readOnly"] is True and mounts["/storage/datasets"]["subPath"] == "datasets"
        for area in ("checkpoints", "logs", "models"):
            m = mounts[f"/storage/{area}/llm-tiny"]
            assert m["readOnly"] is False and m["subPath"] == f"{area}/llm-tiny"
        assert not any(p.rstrip("/") in ("/storage", "/storage/checkpoints") for p in mounts)
        assert not any("hostPath" in v for v in volumes.values())
        # read-only root: /tmp and the compile caches are emptyDirs
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        for path in ("/tmp", "/cache", "/dev/shm"):
            assert "emptyDir" in volumes[mounts[path]["name"]]
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        env = {e["name"]: e for e in c["env"]}
        assert env["TORCHINDUCTOR_CACHE_DIR"]["value"].startswith("/cache/")
        assert env["TRITON_CACHE_DIR"]["value"].startswith("/cache/")
        # no API token in a pod that never calls the API
        assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000 and sc["fsGroupChangePolicy"] == "OnRootMismatch"
        assert c["securityContext"]["privileged"] is False
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert {p["name"] for p in c["ports"]} == {"rdzv"}
        argv = c["args"]
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc-per-node") + 1] == "4"
        assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and argv[argv.index("--max-restarts") + 1] == "3"
        assert "SIGUSR2" in argv[argv.index("--signals-to-handle") + 1]
        assert env["NCCL_DEBUG"]["value"] == "WARN" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "1"
        # the secret comes from a Secret, never as a value
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "llmcluster-secrets", "key": "HF_TOKEN"}}}


def test_service_account_only_when_set(tmp_path):
    job = render(tmp_path, "indexed-job", "--set", "job.k8s.service_account=trainer")[-1]
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer" and pod["automountServiceAccountToken"] is True


def test_the_seeds_two_claim_job_from_its_cluster_file(tmp_path):
    """The seed's form, from clusters/seed-a100.yaml: datasets from one claim (read-only), checkpoints from
    another, image / namespace / node selector / tolerations from the cluster; logs and models, with no
    claim there, stay in the pod."""
    p = run_cli("launch", "--cluster", "seed-a100", "--scheduler", "k8s", "--nodes", "2", "--root", tmp_path / "s",
                "--dry-run",
                check=True)
    objects = list(yaml.safe_load_all(p.stdout))
    validate_all(objects)
    job = objects[-1]
    assert job["kind"] == "Job" and job["metadata"]["namespace"] == "llm" and job["spec"]["completions"] == 2
    pod = job["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "registry.example.com/llmcluster:0.1" and c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    ds, ck = mounts["/storage/datasets"], mounts["/storage/checkpoints/llm-tiny"]
    assert volumes[ds["name"]]["persistentVolumeClaim"] == {"claimName": "datasets-pvc", "readOnly": True}
    assert ds["readOnly"] is True and "subPath" not in ds
    assert volumes[ck["name"]]["persistentVolumeClaim"] == {"claimName": "checkpoints-pvc"}
    assert ck["readOnly"] is False and ck["subPath"] == "llm-tiny"
    assert "emptyDir" in volumes[mounts["/storage/logs/llm-tiny"]["name"]]
    assert not any("llmcluster-storage" in json.dumps(v) for v in volumes.values()), "no implicit shared claim"
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s", "--dry-run",
                "--set", "job.k8s.storage_claim=null")
    assert_one_line_error(p, "no claim for datasets")


def _cluster(tmp_path: Path, host_paths: list[str]) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(yaml.safe_dump({"name": "site", "scheduler": {"kubernetes": {"host_paths": host_paths}}}))
    return p


def test_host_paths_only_where_the_cluster_allows_and_read_only(tmp_path):
    mount = ["--set", "job.mounts=[{source: /opt/site/models, path: /models, read_only: false}]"]
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s", "--dry-run", *mount)
    assert_one_line_error(p, "hostPath", "scheduler.kubernetes.host_paths")
    # the allow-list restricts the job: the job cannot declare it (it moved to the cluster spec)
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s", "--dry-run", *mount,
                "--set", "job.k8s.host_paths=[/opt/site]")
    assert_one_line_error(p, "job.k8s.host_paths moved", "scheduler.kubernetes.host_paths")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({"job": {"k8s": {"host_paths": ["/opt/site"]}}}))
    p = run_cli("launch", "--config", cfg, "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s",
                "--dry-run")
    assert_one_line_error(p, "job.k8s.host_paths moved", "scheduler.kubernetes.host_paths")
    for bad in ("/", "/opt/site/../../etc"):
        p = run_cli("launch", "--cluster", _cluster(tmp_path, [bad]), "--scheduler", "k8s", "--image", IMAGE,
                    "--root", tmp_path / "s", "--dry-run")
        assert_one_line_error(p, "scheduler.kubernetes.host_paths", bad)
    objects = render(tmp_path, "indexed-job", *mount, "--cluster", str(_cluster(tmp_path, ["/opt/site"])))
    validate_all(objects)
    pod = objects[-1]["spec"]["template"]["spec"]
    host = [v for v in pod["volumes"] if "hostPath" in v]
    assert host == [{"name": "host-0", "hostPath": {"path": "/opt/site/models", "type": "Directory"}}]
    assert [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "host-0"][0]["readOnly"] is True
    p = run_cli("launch", "--cluster", _cluster(tmp_path, ["/opt/other"]), "--scheduler", "k8s", "--image", IMAGE,
                "--root", tmp_path / "s", "--dry-run", *mount)
    assert_one_line_error(p, "/opt/site/models", "/opt/other")


@pytest.mark.parametrize("name", ["LLM-Tiny", "llm_tiny", "a" * 60, "llm.tiny"])
def test_names_are_dns_1123_before_anything_is_created(tmp_path, name):
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s", "--dry-run",
                "--set", f"run.name={name}")
    assert_one_line_error(p, "RFC 1123")
    assert not (tmp_path / "s").exists()


CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"
# Checks that do not apply to a batch training job, each with its reason:
CHECKOV_SKIP = {
    "CKV_K8S_8": "liveness probe: a training rank has no endpoint to probe; torchrun watches its ranks",
    "CKV_K8S_9": "readiness probe: no traffic is routed to a trainer (the headless Service publishes not-ready)",
    "CKV_K8S_35": "secrets as files: HF_TOKEN / WANDB_API_KEY are read from the environment by their libraries",
}


FT = ("--set", "ft.enabled=true", "--set", "parallel.dp_replicate=2")   # 2 replica groups of 1 node (issue 37)


def test_every_form_passes_checkov(tmp_path):
    """checkov (from PyPI, in its own venv: `make checkov`) on every built-in object of every form, and on each pod
    template of the custom resources as a Pod (checkov does not look inside CRDs). With ft: the Lighthouse's
    Deployment and Service too. One checkov run over a file per form (its start is ~5 s of CPU), judged per file."""
    assert CHECKOV.is_file(), f"{CHECKOV} missing: run `make checkov`"
    digest = "nvcr.io/nvidia/pytorch:24.07-py3@sha256:" + "a" * 64     # CKV_K8S_43: images by digest
    forms = {k: (k, ()) for k in FORMS} | {"jobset-ft": ("jobset", FT), "jobset-ft3": ("jobset", (  # issue 54
        "--nodes", "3", "--set", "ft.enabled=true", "--set", "parallel.dp_replicate=3", "--set", "log.metrics_bind=0.0.0.0:9400"))}
    (tmp_path / "forms").mkdir()
    for name, (kind, extra) in forms.items():
        objects = render(tmp_path / name, kind, "--image", digest, "--namespace", "ml",
                         "--set", "job.secret_env=[HF_TOKEN]", *extra)
        # the built-in kinds as they are; a custom resource's pod templates as Pods (checkov reads Volcano's
        # kind "Job" as a batch/v1 Job and finds no template in it)
        docs = [o for o in objects if (o["apiVersion"], o["kind"]) not in CRD_SCHEMAS]
        if kind != "indexed-job":
            docs += [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}", "namespace": "ml"},
                      "spec": tpl["spec"]} for i, tpl in enumerate(pod_templates(
                          [o for o in objects[2:] if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]))]
        (tmp_path / "forms" / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    # not --quiet: the passed checks are listed too, counted per form's file below
    p = subprocess.run([str(CHECKOV), "-d", str(tmp_path / "forms"), "--framework", "kubernetes",
                        "--skip-check", ",".join(CHECKOV_SKIP), "--output", "json", "--compact"],
                       capture_output=True, text=True, timeout=300, env={**cli_env(), "BC_SKIP_MAPPING": "TRUE"})
    report = json.loads(p.stdout)
    report = report[0] if isinstance(report, list) else report
    results = report.get("results", {})
    failed = [(c["file_path"], c["check_id"], c["resource"]) for c in results.get("failed_checks", [])]
    assert not failed, failed
    passed = {name: sum(Path(c["file_path"]).stem == name for c in results.get("passed_checks", []))
              for name in forms}
    assert all(n > 20 for n in passed.values()), passed


def test_ft_one_jobset_job_per_group_restarted_alone_beside_a_hardened_lighthouse(tmp_path):
    objects = render(tmp_path, "jobset", *FT, "--set", "ft.min_replicas=1", "--set", "ft.join_timeout_s=5")
    validate_all(objects)
    assert [o["kind"] for o in objects] == ["ConfigMap", "NetworkPolicy", "Deployment", "Service", "JobSet"]
    _, netpol, deploy, svc, js = objects
    groups = js["spec"]["replicatedJobs"]
    assert [g["name"] for g in groups] == ["group-0", "group-1"] and all(g["replicas"] == 1 for g in groups)
    # a failed group's Job is recreated alone (JobSet's RestartJob), counted against job.max_requeues
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 3, "rules": [{
        "name": "restart-the-failed-group-alone", "action": "RestartJob", "targetReplicatedJobs": ["group-0", "group-1"]}]}
    # invariant 4: the first group that saw the run end completes the JobSet; the controller stops the others
    assert js["spec"]["successPolicy"] == {"operator": "Any", "targetReplicatedJobs": ["group-0", "group-1"]}
    for g, rj in enumerate(groups):
        job = rj["template"]["spec"]
        assert job["completions"] == job["parallelism"] == 1 and job["backoffLimit"] == 0
        c = job["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TORCHFT_LIGHTHOUSE"] == "http://llm-tiny-lighthouse:29510"
        assert env["LLMCLUSTER_FT_GROUP"] == str(g) and env["LLMCLUSTER_FT_GROUPS"] == "2"
        argv = c["args"]
        assert argv[argv.index("--nnodes") + 1] == "1"      # the group's own world, its own rendezvous
        assert argv[argv.index("--rdzv-endpoint") + 1] == f"llm-tiny-group-{g}-0-0.llm-tiny:29500"
    # the Lighthouse: one pod, never two at once, hardened like the ranks, fenced by the run's NetworkPolicy
    assert deploy["metadata"]["name"] == svc["metadata"]["name"] == "llm-tiny-lighthouse"
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]
    assert netpol["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"] == pod["metadata"]["labels"] and svc["spec"]["ports"][0]["port"] == 29510
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert [c["command"][0], *c["args"]] == ["torchft_lighthouse", "--min_replicas", "1", "--join_timeout_ms", "5000",
                                             "--bind", "0.0.0.0:29510"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "privileged": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True}
    assert c["resources"]["limits"] == c["resources"]["requests"] == {"cpu": "1", "memory": "512Mi"}


def test_ft_with_a_running_lighthouse_renders_none(tmp_path):
    objects = render(tmp_path, "jobset", *FT, "--set", "ft.lighthouse=lh.example:29999")
    validate_all(objects)
    assert [o["kind"] for o in objects] == ["ConfigMap", "NetworkPolicy", "JobSet"]
    for tpl in pod_templates(objects[2:]):
        env = {e["name"]: e.get("value") for e in tpl["spec"]["containers"][0]["env"]}
        assert env["TORCHFT_LIGHTHOUSE"] == "http://lh.example:29999"


@pytest.mark.parametrize("kind", ["indexed-job", "volcano", "pytorchjob"])
def test_ft_is_refused_where_a_group_cannot_restart_alone(tmp_path, kind):
    p = run_cli("launch", "--scheduler", "k8s", "--k8s-kind", kind, "--nodes", "2", "--image", IMAGE,
                "--root", tmp_path / "s", "--dry-run", *FT)
    assert_one_line_error(p, f"--k8s-kind {kind}", "--k8s-kind jobset")


def test_indexed_job_is_the_seed_form(tmp_path):
    cm, _, svc, job = render(tmp_path, "indexed-job")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "llm-tiny"
    args = pod["containers"][0]["args"]
    assert args[args.index("--rdzv-endpoint") + 1] == "llm-tiny-0.llm-tiny:29500"   # pod 0 via the service
    assert args[args.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)"


def test_volcano_gang_schedules_and_restarts_on_eviction(tmp_path):
    vj = render(tmp_path, "volcano", "--set", "job.k8s.queue=research")[-1]
    s = vj["spec"]
    assert s["minAvailable"] == 2 and s["schedulerName"] == "volcano" and s["queue"] == "research"
    assert set(s["plugins"]) == {"pytorch", "svc", "env"}
    assert {"event": "PodEvicted", "action": "RestartJob"} in s["policies"]
    assert [(t["name"], t["replicas"]) for t in s["tasks"]] == [("master", 1), ("worker", 1)]


def test_misspelt_field_is_caught(tmp_path):
    objects = render(tmp_path, "indexed-job")
    bad = copy.deepcopy(objects)
    bad[-1]["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []   # volumeMounts misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_all(bad)
    for kind, path in (("volcano", ("spec", "minAvaliable")), ("jobset", ("spec", "replicatedJob")),
                       ("pytorchjob", ("spec", "pytorchReplicaSpec"))):
        obj = render(tmp_path, kind)[-1]
        validate_all([obj])
        obj[path[0]][path[1]] = 1
        with pytest.raises(jsonschema.ValidationError):
            validate_all([obj])
    # and inside a CRD's pod template, the core schema catches it
    vj = render(tmp_path, "volcano")[-1]
    vj["spec"]["tasks"][0]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_all([vj])


def test_k8s_needs_an_image_and_valid_names(tmp_path):
    p = run_cli("launch", "--scheduler", "k8s", "--root", tmp_path, "--dry-run")
    assert_one_line_error(p, "image")
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--namespace", "bad;ns", "--root", tmp_path,
                "--dry-run")
    assert_one_line_error(p, "bad;ns")
    p = run_cli("launch", "--scheduler", "k8s", "--image", "x; rm -rf /", "--root", tmp_path, "--dry-run")
    assert_one_line_error(p, "job.image")


# -- --apply / status / cancel against a recording server --------------------------------------------

class Recorder(BaseHTTPRequestHandler):
    calls: list = []
    objects: dict = {}

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    refuse: str | None = None     # a collection path whose POSTs are refused (a quota, an admission webhook)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, body))
        if self.path == self.refuse:
            return self._reply(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
                                     "reason": "Forbidden", "message": "exceeded quota"})
        self.objects[self.path.rstrip("/") + "/" + body["metadata"]["name"]] = body
        self._reply(201, body)

    def do_GET(self):  # noqa: N802
        self.calls.append(("GET", self.path, None))
        base, _, query = self.path.partition("?")
        if "labelSelector=" in query:                 # a list: the objects of that collection with the label
            from urllib.parse import parse_qs
            key, value = parse_qs(query)["labelSelector"][0].split("=", 1)
            items = [o for path, o in self.objects.items() if path.rsplit("/", 1)[0] == base
                     and o["metadata"].get("labels", {}).get(key) == value]
            return self._reply(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items})
        base = base.removesuffix("/status")
        obj = self.objects.get(base)
        if obj is None:
            return self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
        # a Job with its pods active; a serving Deployment with its replica ready (serve start waits for it)
        obj = {**obj, "status": {"readyReplicas": 1, "replicas": 1} if "/deployments/" in base else {"active": 2}}
        self._reply(200, obj)

    def do_DELETE(self):  # noqa: N802
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.calls.append(("DELETE", self.path, body))
        self.objects.pop(self.path, None)
        self._reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    def log_message(self, *a):
        pass


@pytest.fixture
def fake_apiserver(tmp_path):
    Recorder.calls, Recorder.objects, Recorder.refuse = [], {}, None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": f"http://127.0.0.1:{srv.server_port}"}}],
        "users": [{"name": "u", "user": {"token": "test-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "u"}}]}))
    yield cli_env(KUBECONFIG=str(kubeconfig))
    srv.shutdown()


def test_apply_status_cancel_indexed_job(tmp_path, fake_apiserver):
    root = tmp_path / "s"
    p = run_cli("launch", "--scheduler", "k8s", "--nodes", "2", "--image", IMAGE, "--root", root,
                "--namespace", "ml", "--apply", env=fake_apiserver, check=True)
    assert "Job/llm-tiny" in p.stdout
    posts = [(path, body["kind"]) for verb, path, body in Recorder.calls if verb == "POST"]
    assert posts == [("/api/v1/namespaces/ml/configmaps", "ConfigMap"),
                     ("/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies", "NetworkPolicy"),
                     ("/api/v1/namespaces/ml/services", "Service"),
                     ("/apis/batch/v1/namespaces/ml/jobs", "Job")]
    # what was sent is what --dry-run prints and what the launch's job.yaml holds
    sent = [body for verb, _, body in Recorder.calls if verb == "POST"]
    logs = root / "logs" / "llm-tiny"
    assert sent == list(yaml.safe_load_all((logs / "launches" / "1" / "job.yaml").read_text()))
    rec = json.loads((logs / "job.json").read_text())
    assert rec["scheduler"] == "k8s" and rec["k8s"]["namespace"] == "ml"

    st = run_cli("jobs", "status", "llm-tiny", "--root", root, "--json", env=fake_apiserver, check=True)
    assert json.loads(st.stdout)["state"] == "RUNNING"
    # job.json is a user-editable file: names in it are not what cancel deletes (it lists by the run label)
    rec["k8s"]["objects"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "someone-elses"}]
    (logs / "job.json").write_text(json.dumps(rec))
    Recorder.objects["/api/v1/namespaces/ml/configmaps/someone-elses"] = {"metadata": {"name": "someone-elses"}}
    run_cli("jobs", "cancel", "llm-tiny", "--root", root, env=fake_apiserver, check=True)
    deletes = [path for verb, path, _ in Recorder.calls if verb == "DELETE"]
    assert deletes == ["/apis/batch/v1/namespaces/ml/jobs/llm-tiny", "/api/v1/namespaces/ml/services/llm-tiny",
                       "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/llm-tiny",
                       "/api/v1/namespaces/ml/configmaps/llm-tiny-config"]
    job_delete = [b for verb, _, b in Recorder.calls if verb == "DELETE"][0]
    assert job_delete["propagationPolicy"] == "Foreground"
    assert "/api/v1/namespaces/ml/configmaps/someone-elses" in Recorder.objects


def test_a_failed_apply_rolls_back_what_it_created(tmp_path, fake_apiserver):
    Recorder.refuse = "/apis/batch/v1/namespaces/default/jobs"
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s", "--apply",
                env=fake_apiserver)
    assert_one_line_error(p, "403", "rolled back")
    deletes = [path for verb, path, _ in Recorder.calls if verb == "DELETE"]
    assert deletes == ["/api/v1/namespaces/default/services/llm-tiny",
                       "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/llm-tiny",
                       "/api/v1/namespaces/default/configmaps/llm-tiny-config"]
    assert Recorder.objects == {}, "nothing of the run is left on the server"


def test_apply_custom_resource(tmp_path, fake_apiserver):
    run_cli("launch", "--scheduler", "k8s", "--k8s-kind", "jobset", "--image", IMAGE, "--root", tmp_path / "s",
            "--apply", env=fake_apiserver, check=True)
    posts = [path for verb, path, _ in Recorder.calls if verb == "POST"]
    assert posts[-1] == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets"


def test_apply_reports_an_unreachable_server_in_one_line(tmp_path):
    from conftest import free_port
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{free_port()}"}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "u"}}]}))
    p = run_cli("launch", "--scheduler", "k8s", "--image", IMAGE, "--root", tmp_path / "s", "--apply",
                env=cli_env(KUBECONFIG=str(kubeconfig)))
    assert_one_line_error(p, "Kubernetes API")
