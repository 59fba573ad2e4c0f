"""`serve start` without starting an engine: the Kubernetes objects (strict schemas, the training pods' hardening,
checkov), the Slurm and local scripts it renders, and bad input in one line. The model is a real (small, random)
Llama made by transformers; the engine runs in test_serve_vllm.py / test_serve_slurm.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import assert_nowhere_under, assert_one_line_error, cli_env, run_cli
from hf_helpers import make_hf_llama, make_hf_tokenizer
from test_launch_k8s import CHECKOV, K8S_VERSION, Recorder, fake_apiserver  # noqa: F401

kubernetes_validate = pytest.importorskip("kubernetes_validate")
pytest.importorskip("transformers")

DIGEST = "vllm/vllm-openai:v0.11.0@sha256:" + "b" * 64     # checkov CKV_K8S_43: images by digest


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> Path:
    """A storage root whose models/ holds an HF Llama (weights and tokenizer) named `hfx`."""
    root = tmp_path_factory.mktemp("serve") / "storage"
    run_cli("storage", "init", "--root", root, check=True)
    model = make_hf_tokenizer(root / "models" / "hfx")
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    make_hf_llama(model, vocab=len(vocab) + 2, max_shard_size=None)
    return root


def k8s_objects(root: Path, *extra: str) -> list[dict]:
    p = run_cli("serve", "start", "--model", "hfx", "--root", root, "--scheduler", "k8s", "--cluster", "rtx4090-box",
                "--namespace", "ml", "--image", DIGEST, "--set", "job.mem_per_node=64G", "--dry-run", *extra,
                check=True)
    assert not (root / "logs" / "serve-hfx").exists(), "--dry-run must not write anything"
    return list(yaml.safe_load_all(p.stdout))


def test_k8s_objects_validate_strictly_and_are_hardened(hf_root):
    objects = k8s_objects(hf_root)
    assert [o["kind"] for o in objects] == ["ConfigMap", "NetworkPolicy", "Service", "Deployment"]
    for o in objects:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        assert o["metadata"]["namespace"] == "ml" and o["metadata"]["labels"] == {"llmcluster.io/run": "serve-hfx"}
    guard, netpol, svc, dep = objects
    # the API port only, from the namespace's pods labelled as clients and from the Prometheus namespace
    assert netpol["spec"]["ingress"] == [{
        "from": [{"podSelector": {"matchLabels": {"llmcluster.io/serve-client": "true"}}},
                 {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "ports": [{"port": 8000, "protocol": "TCP"}]}]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "protocol": "TCP", "targetPort": "http"}]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}       # the new pod needs the old one's GPUs
    # the pods carry the label the serving PodMonitor of `monitor config --kubernetes` selects
    assert dep["spec"]["template"]["metadata"]["labels"]["llmcluster.io/serve"] == "serve-hfx"
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["image"] == DIGEST and c["imagePullPolicy"] == "Always"
    argv = c["command"] + c["args"]
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    flag = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}
    # the plan's flags for the 2x RTX 4090 box, the export from the read-only models claim
    plan = json.loads(run_cli("serve", "plan", "--model", "hfx", "--root", hf_root, "--cluster", "rtx4090-box",
                              "--json", check=True).stdout)["serve"]
    assert flag["--model"] == "/storage/models/hfx" and flag["--port"] == "8000" and flag["--host"] == "0.0.0.0"
    for key, field in (("--tensor-parallel-size", "tp"), ("--max-model-len", "max_model_len"),
                       ("--max-num-seqs", "max_num_seqs"), ("--dtype", "dtype")):
        assert flag[key] == str(plan[field])
    assert c["resources"]["limits"] == {"nvidia.com/gpu": str(plan["tp"]), "cpu": "32", "memory": "64Gi"}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    model = mounts["/storage/models/hfx"]
    assert model["readOnly"] is True and model["subPath"] == "models/hfx"
    assert volumes[model["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert set(mounts) == {"/storage/models/hfx", "/tmp", "/cache", "/dev/shm", "/opt/llmcluster/guard"}
    # the guard (issue 50): guard.py unchanged in a ConfigMap, mounted read-only on PYTHONPATH, vLLM's --middleware
    from llmcluster.serve import guard as guard_module

    assert guard["metadata"]["name"] == "serve-hfx-guard"
    assert guard["data"] == {"llmcluster_serve_guard.py": Path(guard_module.__file__).read_text()}
    assert mounts["/opt/llmcluster/guard"]["readOnly"] is True
    assert volumes[mounts["/opt/llmcluster/guard"]["name"]]["configMap"] == {"name": "serve-hfx-guard",
                                                                             "defaultMode": 0o444}
    assert flag["--middleware"] == "llmcluster_serve_guard.KeyGuard"
    assert {"name": "PYTHONPATH", "value": "/opt/llmcluster/guard"} in c["env"]
    for path in ("/tmp", "/cache", "/dev/shm"):
        assert "emptyDir" in volumes[mounts[path]["name"]]
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    # the API key from the job's Secret, never a value in the manifest
    assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "serve-hfx-api-key", "key": "api-key"}}} \
        in c["env"] and "--api-key" not in argv
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env["HOME"] == "/tmp" and env["HF_HOME"].startswith("/cache/") and env["VLLM_CACHE_ROOT"].startswith("/cache/")
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"     # the engine's own process groups on loopback (one pod)
    # the training pods' hardening
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    sc = spec["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000 and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                    "privileged": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True}


def test_k8s_objects_pass_checkov(hf_root, tmp_path):
    assert CHECKOV.is_file(), f"{CHECKOV} missing: run `make checkov`"
    (tmp_path / "objects.yaml").write_text(yaml.safe_dump_all(k8s_objects(hf_root)))
    # CKV_K8S_35 (secrets as files): vLLM takes its key from $VLLM_API_KEY or a command-line flag only, and a
    # flag is worse (the pod spec and /proc show it)
    p = subprocess.run([str(CHECKOV), "-f", str(tmp_path / "objects.yaml"), "--framework", "kubernetes",
                        "--skip-check", "CKV_K8S_35", "--output", "json", "--quiet", "--compact"],
                       capture_output=True, text=True, timeout=300, env={**cli_env(), "BC_SKIP_MAPPING": "TRUE"})
    report = json.loads(p.stdout)
    report = report[0] if isinstance(report, list) else report
    failed = [(c["check_id"], c["resource"]) for c in report.get("results", {}).get("failed_checks", [])]
    assert not failed, failed
    assert report["summary"]["passed"] > 20, report["summary"]


def engine(tmp_path: Path, cpu: bool) -> Path:
    """A stand-in for a node's vLLM python (a GPU node's, or the CPU build's) that only answers serve start's
    probe: what is rendered or refused here never runs the engine."""
    fake = tmp_path / "vllm-python"
    info = {"vllm": True, "cpu": "0.32.0" if cpu else None, "gpu": None if cpu else "0.11.0"}
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(info)}'\n")
    fake.chmod(0o755)
    return fake


def test_k8s_start_creates_waits_for_ready_and_cancel_deletes(hf_root, fake_apiserver):
    """Against the recording API server of test_launch_k8s (no cluster runs here): the objects --dry-run shows are
    created, the Deployment's ready replica ends the wait, and `jobs status|cancel` find them by their label."""
    args = ["serve", "start", "--model", "hfx", "--root", hf_root, "--scheduler", "k8s", "--cluster", "rtx4090-box",
            "--namespace", "ml", "--image", DIGEST, "--set", "job.mem_per_node=64G", "--name", "hfx-k8s"]
    shown = list(yaml.safe_load_all(run_cli(*args, "--dry-run", env=fake_apiserver, check=True).stdout))
    p = run_cli(*args, "--timeout", "60", "--prometheus-namespace", "prom", env=fake_apiserver, check=True)
    netpol = shown[1]
    netpol["spec"]["ingress"][0]["from"][1]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] = "prom"
    assert p.stdout.splitlines()[0] == "endpoint http://hfx-k8s.ml.svc:8000/v1"
    assert "the smoke request needs the cluster's DNS" in p.stderr      # the Service's name resolves in-cluster only
    posts = [(path, body) for verb, path, body in Recorder.calls if verb == "POST"]
    assert [path for path, _ in posts] == ["/api/v1/namespaces/ml/secrets", "/api/v1/namespaces/ml/configmaps",
                                           "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies",
                                           "/api/v1/namespaces/ml/services", "/apis/apps/v1/namespaces/ml/deployments"]
    assert [body for _, body in posts[1:]] == shown
    # the job's key: in the Secret created through the API and in the 0600 file, nowhere in what is kept
    key_file = hf_root / "logs" / "hfx-k8s" / "api_key"
    key = key_file.read_text().strip()
    assert posts[0][1]["metadata"]["name"] == "hfx-k8s-api-key" and posts[0][1]["stringData"] == {"api-key": key}
    assert key_file.stat().st_mode & 0o777 == 0o600 and len(key) >= 32
    assert_nowhere_under(hf_root / "logs" / "hfx-k8s" / "launches", key)
    assert key not in p.stdout + p.stderr and f"Bearer $(cat {key_file})" in p.stdout
    rec = json.loads((hf_root / "logs" / "hfx-k8s" / "job.json").read_text())
    assert rec["kind"] == "serve" and rec["endpoint"] == "http://hfx-k8s.ml.svc:8000/v1"
    assert rec["k8s"]["kind"] == "deployment" and rec["k8s"]["namespace"] == "ml"
    st = run_cli("jobs", "status", "hfx-k8s", "--root", hf_root, "--json", env=fake_apiserver, check=True)
    assert json.loads(st.stdout)["state"] == "RUNNING"
    run_cli("jobs", "cancel", "hfx-k8s", "--root", hf_root, env=fake_apiserver, check=True)
    deletes = [path for verb, path, _ in Recorder.calls if verb == "DELETE"]
    assert deletes == ["/apis/apps/v1/namespaces/ml/deployments/hfx-k8s", "/api/v1/namespaces/ml/services/hfx-k8s",
                       "/api/v1/namespaces/ml/secrets/hfx-k8s-api-key",
                       "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/hfx-k8s",
                       "/api/v1/namespaces/ml/configmaps/hfx-k8s-guard"]
    assert key not in st.stdout


def test_slurm_script_waits_for_health_inside_the_job(hf_root, tmp_path):
    fake = engine(tmp_path, cpu=False)
    p = run_cli("serve", "start", "--model", "hfx", "--root", hf_root, "--scheduler", "slurm", "--cluster",
                "rtx4090-box", "--engine-python", fake, "--time", "01:00:00", "--dry-run", check=True)
    text = p.stdout
    assert "#SBATCH --job-name=serve-hfx" in text and "#SBATCH --time=01:00:00" in text
    assert "#SBATCH --gpus-per-node=" in text and "/health" in text and "endpoint-" in text
    assert f"{fake} -m vllm.entrypoints.openai.api_server --model {hf_root / 'models' / 'hfx'}" in text
    assert not (hf_root / "logs" / "serve-hfx").exists()
    # the key: read by the job from its 0600 file when it runs, into vLLM's environment, never on its command line
    key_file = hf_root / "logs" / "serve-hfx" / "api_key"
    assert f"VLLM_API_KEY=$(cat -- {key_file}) || " in text and "export VLLM_API_KEY" in text
    assert "--api-key" not in text


def test_local_script_reads_the_key_at_run_time_and_no_auth_is_said(hf_root, tmp_path):
    """The rendered launch.sh hands vLLM the key from the file (run by bash with a stand-in server that prints
    its environment); --no-auth renders no key and says so."""
    from llmcluster.serve.start import render_local

    import dataclasses

    from llmcluster.serve.engine import Engine

    fake = tmp_path / "server"
    fake.write_text("#!/bin/sh\nenv\n")
    fake.chmod(0o755)
    job = dataclasses.replace(serve_job(tmp_path), engine=Engine(str(fake), "0", cpu=True))
    job.logs.mkdir(parents=True)
    (job.logs / "api_key").write_text("s3cret-key\n")
    text = render_local(job)
    assert "s3cret" not in text
    out = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=30)
    assert "VLLM_API_KEY=s3cret-key" in out.stdout.splitlines(), out
    assert "GLOO_SOCKET_IFNAME=lo" in out.stdout.splitlines()     # its process groups listen on loopback only
    (job.logs / "api_key").unlink()
    assert subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=30).returncode != 0
    p = run_cli("serve", "start", "--model", "hfx", "--root", hf_root, "--scheduler", "local", "--no-auth",
                "--engine-python", engine(tmp_path, cpu=False), "--dry-run", "--port", "8123")
    assert p.returncode == 0 and "VLLM_API_KEY" not in p.stdout and "--no-auth" in p.stdout
    assert "warning: --no-auth: serve-hfx answers anyone" in p.stderr


@pytest.mark.parametrize("args,needle", [
    (["--model", "nope"], "not a model directory, nor an exported run"),
    (["--model", "/no/such/dir"], "no such directory"),
    (["--model", "EMPTY"], "no config.json"),
    (["--model", "hfx", "--name", "../x", "--engine-python", "GPU"], "../x"),
    (["--model", "hfx", "--engine-python", "CPU"], "head dim 16 (64/4) is not one the CPU engine's attention runs"),
    (["--model", "hfx", "--engine-python", "GPU", "--set", "serve.max_model_len=100000"], "max_model_len"),
    (["--model", "hfx", "--engine-python", sys.executable], "has no vllm installed"),
    (["--model", "hfx", "--engine-python", "/no/python"], "no such python"),
    (["--model", "hfx", "--scheduler", "k8s", "--name", "Bad_Name"], "RFC 1123"),
    (["--model", "hfx", "--scheduler", "k8s", "--set", "serve.tp=3", "--cluster", "rtx4090-box"], "tp"),
])
def test_bad_input_is_one_line(hf_root, tmp_path, args, needle):
    (tmp_path / "empty").mkdir()
    named = {"EMPTY": tmp_path / "empty", "GPU": engine(tmp_path / "empty", cpu=False)}
    named["CPU"] = engine(tmp_path, cpu=True)
    args = [str(named.get(a, a)) for a in args]
    p = run_cli("serve", "start", "--root", hf_root, *args, "--dry-run")
    assert_one_line_error(p, needle)


def test_the_engine_is_the_python_of_a_vllm_command_on_path(tmp_path, monkeypatch):
    """Without --engine-python, $LLMCLUSTER_VLLM_PYTHON or a `make vllm` venv: the interpreter of `vllm` on PATH."""
    from llmcluster.serve.engine import find_engine

    python = engine(tmp_path, cpu=True)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm").write_text(f"#!{python}\nimport sys\n")
    (tmp_path / "bin" / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    found = find_engine(None, environ={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert found.python == str(python) and found.cpu and found.version == "0.32.0"


def serve_job(root: Path, served: str = "m", scheduler: str = "local", name: str = "serve-m", port: int = 8000,
              cpu: bool = True):
    """A ServeJob for the renderers without an engine or weights: a preset's shapes, a stand-in python."""
    from llmcluster.serve import engine as eng
    from llmcluster.plan.served_model import from_preset
    from llmcluster.serve.start import ServeJob

    target = eng.Target(from_preset("llm_tiny"), root / "models" / served, served)
    return ServeJob(name, scheduler, root, eng.Engine("/usr/bin/python3", "0", cpu=cpu),
                    target, eng.Sizing(1, "float32", 64, 4), "127.0.0.1", port, 1)


HOSTILE_DIR = "m\nid > PWNED\n#"


@pytest.mark.parametrize("scheduler", ["local", "slurm"])
def test_an_export_named_with_a_line_break_runs_nothing(hf_root, tmp_path, scheduler):
    """Issue 32 High #1: the export directory's name is the served model name; a newline in it must not become a
    command of the rendered script (dry run and the real script run by bash alike)."""
    import shutil

    export = tmp_path / HOSTILE_DIR
    shutil.copytree(hf_root / "models" / "hfx", export)
    fake = engine(tmp_path, cpu=False)
    args = ["serve", "start", "--model", export, "--root", hf_root, "--scheduler", scheduler, "--name", "pwn",
            "--engine-python", fake, "--cluster", "rtx4090-box"]
    p = run_cli(*args, "--dry-run", cwd=tmp_path)
    if p.returncode == 0:      # rendered: run it as the job would (its commands fail harmlessly without a node)
        (tmp_path / "script.sh").write_text(p.stdout)
        subprocess.run(["bash", str(tmp_path / "script.sh")], cwd=tmp_path, capture_output=True, timeout=30)
    assert not (tmp_path / "PWNED").exists()
    assert_one_line_error(p, "line break or control character")
    s = run_cli(*args, "--timeout", "5", cwd=tmp_path)
    assert_one_line_error(s, "line break or control character")
    assert not (tmp_path / "PWNED").exists() and not (hf_root / "logs" / "pwn").exists()


def test_rendered_comments_escape_and_sbatch_lines_come_first(tmp_path):
    """A served name the comment must hold (a control character that reached the renderer) stays in its comment:
    bash parses both scripts, and every #SBATCH line precedes the first command."""
    from llmcluster.serve.start import render_local, render_slurm

    job = serve_job(tmp_path, served="m\x1b[2Jx")
    for text in (render_local(job), render_slurm(job, "10", None)):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
        lines = text.splitlines()
        assert all(ln.isascii() and ln.isprintable() for ln in lines if ln.startswith("#"))
        first_cmd = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
        assert all(i < first_cmd for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))


def test_an_export_named_port_gets_the_nodes_port(hf_root, tmp_path):
    """Issue 32 (low): the Slurm script's port is the shell's $port, whatever the export is called."""
    import shutil

    shutil.copytree(hf_root / "models" / "hfx", tmp_path / "PORT")
    p = run_cli("serve", "start", "--model", tmp_path / "PORT", "--root", hf_root, "--scheduler", "slurm",
                "--engine-python", engine(tmp_path, cpu=False), "--cluster", "rtx4090-box", "--dry-run", check=True)
    server = next(ln for ln in p.stdout.splitlines() if "vllm.entrypoints.openai.api_server" in ln)
    assert " --served-model-name PORT " in server and ' --port "$port" ' in server, server
    assert subprocess.run(["bash", "-n"], input=p.stdout, text=True).returncode == 0


def test_a_relative_lora_base_is_relative_to_the_adapter(hf_root, tmp_path):
    """Issue 32 (low): adapter_config.json's relative base_model_name_or_path resolves against the adapter's
    directory, not against the directory `serve start` runs in."""
    import shutil

    shutil.copytree(hf_root / "models" / "hfx", tmp_path / "base")
    export = tmp_path / "runs" / "tuned"
    shutil.copytree(hf_root / "models" / "hfx", export)
    (export / "adapter").mkdir()
    (export / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../../../base",
                                                                         "r": 4}))
    (tmp_path / "elsewhere").mkdir()
    p = run_cli("serve", "start", "--model", export, "--root", hf_root, "--engine-python", engine(tmp_path, cpu=False),
                "--cluster", "rtx4090-box", "--dry-run", cwd=tmp_path / "elsewhere", check=True)
    server = next(ln for ln in p.stdout.splitlines() if "vllm.entrypoints.openai.api_server" in ln)
    assert f" --model {tmp_path / 'base'} " in server and f"tuned={export / 'adapter'}" in server, server


@pytest.mark.parametrize("flag,value", [("--port", "0"), ("--port", "99999"), ("--timeout", "-5"),
                                        ("--timeout", "0"), ("--timeout", "nan")])
def test_port_and_timeout_are_checked_before_launching(hf_root, tmp_path, flag, value):
    """Issue 34 item 6: one line, exit 2, no record and no process (the stand-in engine would otherwise run)."""
    p = run_cli("serve", "start", "--model", "hfx", "--root", hf_root, "--name", "bad-flags", "--engine-python",
                engine(tmp_path, cpu=False), "--cluster", "rtx4090-box", flag, value)
    assert_one_line_error(p, flag)
    assert not (hf_root / "logs" / "bad-flags").exists()


def test_a_port_in_use_is_refused_before_launching(hf_root, tmp_path):
    """Issue 64: a server already on --port answered /health for ours, while the new one kept starting and was
    recorded RUNNING. One line (as `monitor serve` says it), exit 2, no record and no process."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = run_cli("serve", "start", "--model", "hfx", "--root", hf_root, "--name", "busy-port", "--engine-python",
                    engine(tmp_path, cpu=False), "--cluster", "rtx4090-box", "--port", port, "--timeout", "5")
    assert_one_line_error(p, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert not (hf_root / "logs" / "busy-port").exists()   # no launch.sh, so nothing it started either


def fake_server(tmp_path: Path, port: int, own_group: bool, ignore_term: bool = False) -> subprocess.Popen:
    """A process `jobs` takes for a local serving job's vLLM (its module and --port on its command line) that takes
    2 s to stop after SIGTERM (or ignores it)."""
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, {'signal.SIG_IGN' if ignore_term else 'lambda *a: (time.sleep(2), sys.exit(0))'})\n"
            "print('up', flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "vllm.entrypoints.openai.api_server", "--port", str(port)],
                            stdout=subprocess.PIPE, start_new_session=own_group)
    assert proc.stdout.readline() == b"up\n"
    logs = tmp_path / "root" / "logs" / "srv"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "job.json").write_text(json.dumps({"run": "srv", "kind": "serve", "scheduler": "local", "pid": proc.pid,
                                               "job_id": f"local-{proc.pid}", "port": port, "state": "RUNNING"}))
    return proc


def test_cancel_waits_for_the_server_to_be_gone(tmp_path, capsys):
    from conftest import cli_inprocess

    proc = fake_server(tmp_path, 18123, own_group=True)
    try:
        p = cli_inprocess(capsys, "jobs", "cancel", "srv", "--root", tmp_path / "root")
        assert p.returncode == 0 and p.stdout.startswith("cancelled srv"), p
        assert "stopping srv" in p.stderr
        assert proc.poll() is not None or proc.wait(timeout=1) is not None    # gone before CANCELLED was said
        rec = json.loads((tmp_path / "root" / "logs" / "srv" / "job.json").read_text())
        assert rec["state"] == "CANCELLED"
    finally:
        proc.kill()


def test_cancel_says_still_stopping_then_status_says_cancelled(tmp_path, capsys, monkeypatch):
    from conftest import cli_inprocess
    from llmcluster.launch import local

    monkeypatch.setattr(local, "CANCEL_WAIT_S", 1)
    proc = fake_server(tmp_path, 18124, own_group=True, ignore_term=True)
    try:
        p = cli_inprocess(capsys, "jobs", "cancel", "srv", "--root", tmp_path / "root")
        assert p.returncode == 0 and "still stopping after 1 s" in p.stdout, p
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    st = cli_inprocess(capsys, "jobs", "status", "srv", "--root", tmp_path / "root", "--json")
    assert json.loads(st.stdout)["state"] == "CANCELLED"


def test_cancel_of_a_pid_that_leads_no_group_is_one_line(tmp_path):
    """Issue 32 (low): a live pid that matches the record but is not a group leader (not a process we started in
    a session of its own) is not signalled, and said in one line (was a ProcessLookupError traceback)."""
    proc = fake_server(tmp_path, 18125, own_group=False)
    try:
        p = run_cli("jobs", "cancel", "srv", "--root", tmp_path / "root")
        assert_one_line_error(p, "does not lead its process group")
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def engine_environment(tmp_path: Path, caller: dict[str, str], scheduler: str = "local") -> dict[str, str]:
    """The environment the rendered script's server gets (a stand-in that prints it), run by bash under `caller`'s
    environment (for Slurm: the script's engine lines with the scontrol/health loop left out)."""
    import dataclasses

    from llmcluster.serve.engine import Engine
    from llmcluster.serve.start import render_local

    fake = tmp_path / "server"
    fake.write_text("#!/bin/sh\nenv -0\n")
    fake.chmod(0o755)
    job = dataclasses.replace(serve_job(tmp_path), engine=Engine(str(fake), "0", cpu=True))
    job.logs.mkdir(parents=True, exist_ok=True)
    (job.logs / "api_key").write_text("s3cret-key\n")
    out = subprocess.run(["bash", "-c", render_local(job)], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", **caller}, check=True).stdout
    return dict(kv.split("=", 1) for kv in out.split("\0") if kv)


def test_the_engine_gets_an_allow_listed_environment_not_the_callers(tmp_path):
    """Issue 65: a caller's SAGEMAKER_*/CUSTOM_* (the engine's SageMaker bootstrap imports code and places
    middleware from them) or PYTHONPATH never reaches the engine; what the script sets and CUDA_* do."""
    from llmcluster.serve.start import render_slurm

    caller = {"SAGEMAKER_MODEL_PATH": "/tmp/x", "CUSTOM_FASTAPI_PING_HANDLER": "evil:ping", "PYTHONPATH": "/tmp/x",
              "CUDA_VISIBLE_DEVICES": "0,1", "LC_ALL": "C", "HOME": "/root", "VLLM_PLUGINS": "evil"}
    env = engine_environment(tmp_path, caller)
    assert not {"SAGEMAKER_MODEL_PATH", "CUSTOM_FASTAPI_PING_HANDLER", "VLLM_PLUGINS"} & set(env), env
    assert env["PYTHONPATH"] != "/tmp/x" and env["VLLM_API_KEY"] == "s3cret-key"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["GLOO_SOCKET_IFNAME"] == "lo" and env["LC_ALL"] == "C"
    # the Slurm script starts its server the same way (sbatch --export=ALL hands it the submitter's environment)
    text = render_slurm(serve_job(tmp_path, scheduler="slurm"), None, None)
    assert 'env -i "${engine_env[@]}" /usr/bin/python3 -m vllm' in text and "compgen -e" in text


def pinned_engine_site() -> Path | None:
    from llmcluster.serve.engine import built_venvs

    for python in built_venvs():
        for site in python.parent.parent.glob("lib/python3*/site-packages"):
            if (site / "model_hosting_container_standards").is_dir():
                return site
    return None


def test_no_variable_the_pinned_engines_sagemaker_bootstrap_reads_reaches_it(tmp_path):
    """Every upper-case string of the pinned engine's SageMaker bootstrap (model_hosting_container_standards and
    vllm's sagemaker router: the names it reads, the prefixes it scans) set in the caller's environment: none
    reaches the engine."""
    import ast
    import re

    site = pinned_engine_site()
    if site is None:
        pytest.skip("no `make vllm` engine venv with model_hosting_container_standards on this machine")
    names = set()
    for d in (site / "model_hosting_container_standards", site / "vllm" / "entrypoints" / "serve" / "sagemaker"):
        for f in d.rglob("*.py"):
            names |= {n.value for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.Constant)
                      and isinstance(n.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]{2,}", n.value)}
    assert {"SAGEMAKER_MODEL_PATH", "CUSTOM_SCRIPT_FILENAME", "SAGEMAKER_"} <= names     # the bootstrap was read
    caller = {n + "X" if n.endswith("_") else n: "planted" for n in names}
    env = engine_environment(tmp_path, caller)
    assert not {k for k, v in env.items() if v == "planted"}, env
