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
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import assert_one_line_error, cli_env, run_cli

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


@pytest.mark.parametrize("kind", ["indexed-job", "volcano", "jobset", "pytorchjob"])
def test_every_form_validates_strictly_and_has_the_essentials(tmp_path, kind):
    objects = render(tmp_path, kind)
    validate_all(objects)
    cm = objects[0]
    assert cm["kind"] == "ConfigMap" and yaml.safe_load(cm["data"]["config.yaml"])["job"]["nodes"] == 2
    pods = list(pod_templates(objects[1:]))
    assert pods
    for tpl in pods:
        spec = tpl["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "4", "cpu": "32", "memory": "480Gi"}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/storage/datasets"]["readOnly"] is True
        assert mounts["/storage/checkpoints"]["readOnly"] is False
        assert mounts["/storage/logs"]["readOnly"] is False
        shm = [v for v in spec["volumes"] if v["name"] == "dshm"][0]
        assert shm["emptyDir"]["medium"] == "Memory" and "/dev/shm" in mounts
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["privileged"] is False
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        argv = c["args"]
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc-per-node") + 1] == "4"
        assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
        assert "SIGUSR2" in argv[argv.index("--signals-to-handle") + 1]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_DEBUG"] == "WARN" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_indexed_job_is_the_seed_form(tmp_path):
    cm, svc, job = render(tmp_path, "indexed-job")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == "llm-tiny"
    args = pod["containers"][0]["args"]
    assert args[args.index("--rdzv-endpoint") + 1] == "llm-tiny-0.llm-tiny:29500"   # pod 0 via the service
    assert args[args.index("--node-rank") + 1] == "$(JOB_COMPLETION_INDEX)"


def test_volcano_gang_schedules_and_restarts_on_eviction(tmp_path):
    _, vj = render(tmp_path, "volcano", "--set", "job.k8s.queue=research")
    s = vj["spec"]
    assert s["minAvailable"] == 2 and s["schedulerName"] == "volcano" and s["queue"] == "research"
    assert set(s["plugins"]) == {"pytorch", "svc", "env"}
    assert {"event": "PodEvicted", "action": "RestartJob"} in s["policies"]
    assert [(t["name"], t["replicas"]) for t in s["tasks"]] == [("master", 1), ("worker", 1)]


def test_misspelt_field_is_caught(tmp_path):
    objects = render(tmp_path, "indexed-job")
    bad = copy.deepcopy(objects)
    bad[2]["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []   # volumeMounts misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_all(bad)
    for kind, path in (("volcano", ("spec", "minAvaliable")), ("jobset", ("spec", "replicatedJob")),
                       ("pytorchjob", ("spec", "pytorchReplicaSpec"))):
        obj = render(tmp_path, kind)[1]
        validate_all([obj])
        obj[path[0]][path[1]] = 1
        with pytest.raises(jsonschema.ValidationError):
            validate_all([obj])
    # and inside a CRD's pod template, the core schema catches it
    vj = render(tmp_path, "volcano")[1]
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

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, body))
        self.objects[self.path.rstrip("/") + "/" + body["metadata"]["name"]] = body
        self._reply(201, body)

    def do_GET(self):  # noqa: N802
        self.calls.append(("GET", self.path, None))
        base = self.path.split("?")[0].removesuffix("/status")
        obj = self.objects.get(base)
        if obj is None:
            return self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
        obj = {**obj, "status": {"active": 2}}
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
    Recorder.calls, Recorder.objects = [], {}
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
                     ("/api/v1/namespaces/ml/services", "Service"),
                     ("/apis/batch/v1/namespaces/ml/jobs", "Job")]
    # what was sent is what --dry-run prints and what job.yaml holds
    sent = [body for verb, _, body in Recorder.calls if verb == "POST"]
    assert sent == list(yaml.safe_load_all((root / "logs" / "llm-tiny" / "job.yaml").read_text()))
    rec = json.loads((root / "logs" / "llm-tiny" / "job.json").read_text())
    assert rec["scheduler"] == "k8s" and rec["k8s"]["namespace"] == "ml"

    st = run_cli("jobs", "status", "llm-tiny", "--root", root, "--json", env=fake_apiserver, check=True)
    assert json.loads(st.stdout)["state"] == "RUNNING"
    run_cli("jobs", "cancel", "llm-tiny", "--root", root, env=fake_apiserver, check=True)
    deletes = [path for verb, path, _ in Recorder.calls if verb == "DELETE"]
    assert deletes == ["/apis/batch/v1/namespaces/ml/jobs/llm-tiny", "/api/v1/namespaces/ml/services/llm-tiny",
                       "/api/v1/namespaces/ml/configmaps/llm-tiny-config"]
    job_delete = [b for verb, _, b in Recorder.calls if verb == "DELETE"][0]
    assert job_delete["propagationPolicy"] == "Foreground"


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
