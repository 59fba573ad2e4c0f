"""`serve start` with the real engine: vLLM's CPU build serving a demo-sized export and a LoRA adapter on it,
through the one session-scoped server of conftest's `vllm_server` (scripts/vllm_venv.sh builds the engine)."""

from __future__ import annotations

import functools
import json
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]

PROMPTS = ["def ", "What is 7", "import json\n"]


def post(url: str, body: dict, headers: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def complete(server, model: str, prompt: str, n: int = 24, **extra) -> dict:
    return post(f"{server.base_url}/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                   "temperature": 0, **extra}, server.headers)


@functools.lru_cache(maxsize=2)
def _exported(path: Path):
    from llmcluster.export.generate import load_exported

    return load_exported(path)


def generate_ids(export: Path, prompt: str, n: int = 24) -> tuple[list[int], list[int]]:
    """The prompt's ids and the greedy continuation `llmcluster generate` computes (its own model code, KV
    cache), here without its stop at the end-of-text id (vLLM stops at the end-of-turn id too; ignore_eos)."""
    import torch

    from llmcluster.export.generate import sample

    net, tok, cfg = _exported(export)
    ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.tok.encode(prompt, add_special_tokens=False).ids
    return ids, sample(net, ids, n, 0.0, 0, cfg.max_seq_len, None, torch.Generator())


def assert_same_tokens(server, model: str, export: Path, prompt: str) -> None:
    out = complete(server, model, prompt, ignore_eos=True, return_token_ids=True)
    choice = out["choices"][0]
    ids, new = generate_ids(export, prompt)
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == new and len(new) == 24, (choice["token_ids"], new)


def test_the_job_is_recorded_and_answers_jobs(vllm_server):
    rec = json.loads((vllm_server.root / "logs" / vllm_server.name / "job.json").read_text())
    assert rec["kind"] == "serve" and rec["endpoint"] == vllm_server.base_url and rec["scheduler"] == "local"
    assert rec["model"] == vllm_server.lora and rec["adapter"] == str(vllm_server.lora_dir / "adapter")
    assert vllm_server.start.stdout.splitlines()[-1].startswith(f"curl -s {vllm_server.base_url[:-3]}/v1/completions")
    # the CPU engine starts eager: vLLM's dynamo trace at start is ~half of it on 2 cores (serve/engine.py)
    assert " --enforce-eager" in Path(rec["artifact"]).read_text()
    st = run_cli("jobs", "status", vllm_server.name, "--root", vllm_server.root, "--json", check=True)
    assert json.loads(st.stdout)["state"] == "RUNNING"
    logs = run_cli("jobs", "logs", vllm_server.name, "--root", vllm_server.root, check=True)
    assert "POST /v1/completions" in logs.stdout          # the smoke request serve start sent
    with urllib.request.urlopen(urllib.request.Request(f"{vllm_server.base_url}/models",
                                                       headers=vllm_server.headers), timeout=30) as r:
        served = {m["id"] for m in json.loads(r.read())["data"]}
    assert served == {vllm_server.model, vllm_server.lora}


def test_the_served_model_needs_its_key(vllm_server, tmp_path):
    """Issue 32 High #3: serve start made a key (0600 file); vLLM answers /v1 with it only; the key is on no command
    line, in no kept artefact and in no `jobs status`; the printed curl reads it from its file."""
    import os
    import subprocess
    import urllib.error

    from conftest import assert_nowhere_under

    logs = vllm_server.root / "logs" / vllm_server.name
    assert (logs / "api_key").stat().st_mode & 0o777 == 0o600
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{vllm_server.base_url}/models", timeout=30)
    assert e.value.code == 401
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(f"{vllm_server.base_url}/models",
                                                      headers={"Authorization": "Bearer wrong"}), timeout=30)
    assert e.value.code == 401
    req = urllib.request.Request(f"{vllm_server.base_url}/models", headers=vllm_server.headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{vllm_server.base_url[:-3]}/health", timeout=30) as r:
        assert r.status == 200                                  # open, as docs/security.md says
    rec = json.loads((logs / "job.json").read_text())
    assert rec["auth"] is True and vllm_server.key not in (logs / "job.json").read_text()
    assert vllm_server.key.encode() not in open(f"/proc/{rec['pid']}/cmdline", "rb").read()
    assert_nowhere_under(logs / "launches", vllm_server.key)
    st = run_cli("jobs", "status", vllm_server.name, "--root", vllm_server.root, check=True)
    assert vllm_server.key not in st.stdout + st.stderr
    curl = vllm_server.start.stdout.splitlines()[-1]
    assert vllm_server.key not in vllm_server.start.stdout + vllm_server.start.stderr
    assert f"Bearer $(cat {logs / 'api_key'})" in curl
    out = subprocess.run(["bash", "-c", curl],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert json.loads(out.stdout)["choices"][0]["text"], out


# the live server's routes as its app has them, include_in_schema=False ones too (/openapi.json omits those):
# vLLM 0.32's build_app in the engine's python, with the server's own arguments and the guard it imports
ROUTES = r"""
import json, sys
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
app = build_app(make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:]), ("generate",), None)
print(json.dumps({"routes": [[r.path, sorted(getattr(r, "methods", None) or ["GET"])] for r in app.routes],
                  "middleware": [m.cls.__name__ for m in app.user_middleware]}))
"""
OPEN = {"/health", "/ping", "/metrics", "/version"}


def status(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None) -> int:
    import urllib.error

    data = json.dumps(body).encode() if body is not None else (b"{}" if method in ("POST", "PUT", "PATCH") else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_every_route_but_the_open_ones_needs_the_key(vllm_server):
    """Issue 50: deny by default. Every route of the live engine (its app's routes, /openapi.json's and those the
    schema omits: /invocations, /generative_scoring, /scale_elastic_ep, ...) answers 401 without the key but
    /health, /ping, /metrics and /version; with the key a generating route still answers 200."""
    import subprocess

    logs = vllm_server.root / "logs" / vllm_server.name
    rec = json.loads((logs / "job.json").read_text())
    launch = Path(rec["artifact"]).parent
    shipped = launch / "llmcluster_serve_guard.py"
    from llmcluster.serve import guard

    assert shipped.read_text() == Path(guard.__file__).read_text() and shipped.stat().st_mode & 0o777 == 0o400
    argv = open(f"/proc/{rec['pid']}/cmdline", "rb").read().decode().split("\0")[:-1]
    server_args = argv[argv.index("vllm.entrypoints.openai.api_server") + 1:]
    assert server_args[-2:] == ["--middleware", "llmcluster_serve_guard.KeyGuard"]
    p = subprocess.run([vllm_server.python, "-c", ROUTES, *server_args], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(vllm_server.root), "PYTHONPATH": str(launch),
                            "VLLM_API_KEY": "not-the-key", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    app = json.loads(p.stdout.splitlines()[-1])
    # the guard is the outermost of the engine's middleware; vLLM's own /v1 guard stays behind it
    assert app["middleware"][0] == "KeyGuard" and "AuthenticationMiddleware" in app["middleware"], app["middleware"]
    base = vllm_server.base_url.removesuffix("/v1")
    with urllib.request.urlopen(urllib.request.Request(f"{base}/openapi.json", headers=vllm_server.headers),
                                timeout=30) as r:
        schema = json.loads(r.read())["paths"]
    routes = {(path, m) for path, methods in app["routes"] for m in methods}
    routes |= {(path, m.upper()) for path, ops in schema.items() for m in ops}
    paths = {path for path, _ in routes}
    assert {"/invocations", "/generative_scoring", "/scale_elastic_ep", "/is_scaling_elastic_ep", "/tokenize",
            "/openapi.json", "/docs"} <= paths and OPEN <= paths
    answered = {}
    for path, method in sorted(routes):
        url = base + path.replace("{", "").replace("}", "")
        answered[method, path] = status(url, method)
        if path not in OPEN:
            assert status(url, method, {"Authorization": "Bearer wrong"}) == 401, (method, path)
    refused = {k for k, code in answered.items() if code in (401, 403)}
    assert {k for k in answered if k[1] not in OPEN} == refused, sorted(set(answered) - refused)
    assert all(answered[m, path] == 200 for m, path in answered if path in OPEN and m == "GET"), answered
    # with the key: a generating route the old guard left open answers, as /v1 does
    body = {"model": vllm_server.model, "prompt": "def ", "max_tokens": 2, "temperature": 0}
    assert status(f"{base}/invocations", "POST", vllm_server.headers, body) == 200
    assert status(f"{base}/invocations", "POST", {}, body) == 401
    print(f"{len(answered)} routes walked, {len(refused)} refused without the key", file=sys.stderr)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completions_equal_generate(vllm_server, prompt):
    assert_same_tokens(vllm_server, vllm_server.model, vllm_server.export_dir, prompt)


def test_lora_adapter_of_an_imported_base_answers_as_its_merged_export(vllm_server):
    """The adapter (PEFT, on the HF base the run imported with train.init_from) served by vLLM's LoRA support
    answers greedily as `generate` on the export's merged weights does."""
    out = complete(vllm_server, vllm_server.lora, PROMPTS[0])
    assert out["model"] == vllm_server.lora and out["choices"][0]["text"]
    for prompt in PROMPTS[:2]:
        assert_same_tokens(vllm_server, vllm_server.lora, vllm_server.lora_dir, prompt)


def test_streaming_gives_the_same_text_in_pieces(vllm_server):
    prompt = PROMPTS[0]
    whole = complete(vllm_server, vllm_server.model, prompt, ignore_eos=True)["choices"][0]["text"]
    req = urllib.request.Request(f"{vllm_server.base_url}/completions",
                                 headers={"Content-Type": "application/json", **vllm_server.headers},
                                 data=json.dumps({"model": vllm_server.model, "prompt": prompt, "max_tokens": 24,
                                                  "temperature": 0, "ignore_eos": True, "stream": True}).encode())
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert len([c for c in chunks if c["text"]]) > 1              # pieces, not one answer at the end
    assert "".join(c["text"] for c in chunks) == whole
    assert chunks[-1]["finish_reason"] == "length"


def test_chat_completion_stops_at_the_end_of_turn_token(vllm_server):
    """The export's chat template formats the messages, and its end-of-turn token is among the eos ids: a reply
    that reaches it ends there with finish_reason "stop" (logit_bias makes this briefly trained model reach it
    after its first token)."""
    gen = json.loads((vllm_server.export_dir / "generation_config.json").read_text())
    tok = json.loads((vllm_server.export_dir / "tokenizer.json").read_text())
    turn = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|im_end|>")
    assert turn in gen["eos_token_id"]
    out = post(f"{vllm_server.base_url}/chat/completions", {
        "model": vllm_server.model, "messages": [{"role": "user", "content": "What is 3 + 3?"}],
        "max_tokens": 40, "temperature": 0, "logit_bias": {str(turn): 100}}, vllm_server.headers)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1, out
    assert choice["message"]["content"] == ""          # the end-of-turn token ends the reply; it is not text


@pytest.mark.prometheus
def test_real_prometheus_scrapes_the_engine_and_the_serving_rules_evaluate(vllm_server, tmp_path):
    """`monitor config` finds the serving job in its record; the real Prometheus scrapes vLLM's /metrics with the
    serving rules and alerts loaded; every vllm:* name our rules and dashboard read is in the live scrape."""
    import yaml
    from monitor_helpers import (DASHBOARDS, MONITORING, dashboard_queries, families, http_get_json,
                                 promql_metric_names)
    from test_monitor_prometheus import Prometheus

    from conftest import free_port

    complete(vllm_server, vllm_server.model, PROMPTS[0], n=8)     # the latency histograms get a sample
    with urllib.request.urlopen(f"{vllm_server.base_url[:-3]}/metrics", timeout=30) as r:
        live = set(families(r.read().decode()))
    exprs = [r["expr"] for f in ("recording.yml", "alerts.yml")
             for g in yaml.safe_load((MONITORING / f).read_text())["groups"] for r in g["rules"]]
    exprs += [e for d in DASHBOARDS for e in dashboard_queries(d)]
    read = {n for e in exprs for n in promql_metric_names(e) if n.startswith("vllm:")}
    assert read and read <= live, sorted(read - live)

    out = tmp_path / "prometheus.yml"
    run_cli("monitor", "config", "--nodes", "127.0.0.1", "--port", str(free_port()), "--train-port", "-1",
            "--scrape-interval", "1s", "--root", vllm_server.root, "--out", out, check=True)
    prom = Prometheus(out, tmp_path / "data")
    try:
        sel = f'serve_name="{vllm_server.name}"'
        (up,) = prom.wait_for(f'up{{job="llmcluster-serve", {sel}}} == 1', what="the engine scraped")
        assert up["metric"]["instance"] == vllm_server.base_url.split("/")[2]
        prom.wait_for(f"llmcluster:serve_kv_cache_usage:max{{{sel}}}", what="the KV-cache recording rule")
        prom.wait_for(f"llmcluster:serve_requests_running:sum{{{sel}}}", what="the running-requests rule")
        groups = {g["name"] for g in http_get_json(f"{prom.url}/api/v1/rules")["data"]["groups"]}
        assert {"llmcluster-serve", "llmcluster-serve-recording"} <= groups
    finally:
        prom.stop()
