"""Deny by default (issue 50): serve/guard.py, the ASGI middleware vLLM loads with `--middleware`, without an engine:
every route of the Kubernetes and Slurm image's vLLM (v0.11.0, its routes listed below from its source) needs the
key but the open ones, and the three forms ship it. The live CPU engine's routes (0.32.0) are walked in
test_serve_vllm.py."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from llmcluster.serve import auth, guard
from test_render_boundary import serve_job

KEY = "k-" + "x" * 40
OPEN = {"/health", "/ping", "/metrics", "/version"}

# vllm/vllm-openai:v0.11.0, the image the Slurm and Kubernetes forms name: vllm 0.11.0's sdist from PyPI
# (vllm-0.11.0.tar.gz, sha256 f435a64c24e9c4178d657a76f8edd8548ddc444012f7d06a9f79ac3a6392bfae), every route
# vllm/entrypoints/openai/api_server.py registers: its @router.get/post decorators (those behind a flag or an
# environment variable included), mount_metrics() (the Instrumentator's GET /metrics and the Mount /metrics, whose
# path_regex '^/metrics(?P<path>.*)$' takes /metrics<anything>) and FastAPI's own docs routes (build_app without
# --disable-fastapi-docs). Its AuthenticationMiddleware guards paths starting with /v1 only.
V0110_ROUTES = [
    ("GET", "/health"), ("GET", "/load"), ("GET", "/ping"), ("POST", "/ping"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/version"), ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"), ("POST", "/pooling"),
    ("POST", "/classify"), ("POST", "/score"), ("POST", "/v1/score"), ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"), ("POST", "/rerank"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"),
    ("POST", "/scale_elastic_ep"), ("POST", "/is_scaling_elastic_ep"), ("POST", "/invocations"),
    ("GET", "/tokenizer_info"),                                           # --enable-tokenizer-info-endpoint
    ("GET", "/server_info"), ("POST", "/reset_prefix_cache"), ("POST", "/sleep"), ("POST", "/wake_up"),
    ("GET", "/is_sleeping"), ("POST", "/collective_rpc"),                 # VLLM_SERVER_DEV_MODE
    ("POST", "/start_profile"), ("POST", "/stop_profile"),                # VLLM_TORCH_PROFILER_DIR
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),   # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    ("GET", "/metrics"), ("POST", "/metrics"), ("GET", "/metrics/anything"),  # mount_metrics
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc"),   # FastAPI
]


def call(path: str, method: str = "GET", headers=(), kind: str = "http", key: str = KEY) -> object:
    """One request through KeyGuard in this process: "app" when it reached the application, else what the guard
    sent (the status, or the websocket close)."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b""}

    old = dict(os.environ)
    os.environ[guard.KEY_ENV] = key
    try:
        g = guard.KeyGuard(app)
    finally:
        os.environ.clear()
        os.environ.update(old)
    scope = {"type": kind, "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    if kind == "http":
        scope["method"] = method
    asyncio.run(g(scope, receive, send))
    if reached:
        return "app"
    if sent[0]["type"] == "websocket.close":
        return "closed"
    return sent[0]["status"]


BEARER = [("authorization", f"Bearer {KEY}")]


@pytest.mark.parametrize("method,path", V0110_ROUTES)
def test_every_v0110_route_but_the_open_ones_needs_the_key(method, path):
    path = path.replace("{response_id}", "resp-1")
    want = "app" if path in OPEN else 401
    assert call(path, method) == want
    assert call(path, method, [("authorization", "Bearer wrong")]) == want
    assert call(path, method, BEARER) == "app"


def test_the_open_list_is_exactly_four_routes_of_v0110_and_nothing_else():
    """The guard's open list covers nothing but /health, /ping, /metrics and /version, and each is a v0.11.0 route
    (a route renamed upstream would otherwise stay open under its new name, or the probe would break)."""
    assert guard.OPEN == OPEN
    assert {p for m, p in V0110_ROUTES if call(p.replace("{response_id}", "r"), m) == "app"} == OPEN
    assert OPEN <= {p for _, p in V0110_ROUTES}


@pytest.mark.parametrize("path", ["/health/", "//health", "/Health", "/health%2F..", "/metricsx", "/metrics/",
                                  "/ping/../v1/models", "", "*", "/"])
def test_a_path_that_only_looks_open_needs_the_key(path):
    assert call(path) == 401


@pytest.mark.parametrize("headers,want", [
    (BEARER, "app"),
    ([("Authorization", f"bearer {KEY}")], "app"),                       # the scheme is case-insensitive
    ([("authorization", KEY)], 401),                                     # no scheme
    ([("authorization", f"Basic {KEY}")], 401),
    ([("authorization", f"Bearer {KEY} ")], 401),
    ([("authorization", f"Bearer  {KEY}")], 401),
    ([("authorization", f"Bearer {KEY[:-1]}")], 401),
    (BEARER + [("authorization", "Bearer wrong")], 401),                 # two: which one a proxy reads is unknown
    ([("x-api-key", KEY)], 401),
    ([], 401),
])
def test_only_one_bearer_with_the_exact_key_passes(headers, want):
    assert call("/v1/completions", "POST", headers) == want


def test_other_methods_websockets_and_lifespan():
    assert call("/v1/completions", "OPTIONS", [("origin", "http://x"), ("access-control-request-method", "POST")]) \
        == 401                                                  # a CORS preflight carries no key: refused too
    assert call("/v1/realtime", kind="websocket") == "closed"   # before it is accepted: the client sees 403
    assert call("/v1/realtime", kind="websocket", headers=BEARER) == "app"
    assert call("", kind="lifespan") == "app"


def test_no_key_no_server():
    """An empty $VLLM_API_KEY would leave vLLM's own guard off: the guard refuses to be built (the server does not
    start) rather than answer no one, or everyone."""
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is empty"):
        call("/health", key="")


def test_the_guard_needs_nothing_but_the_standard_library():
    """It runs in the engine's venv and image, which have no llmcluster (and no promise of starlette's API)."""
    tree = ast.parse(Path(guard.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"hashlib", "hmac", "os"}
    assert auth.guard_source() == Path(guard.__file__).read_text()


def test_local_and_slurm_scripts_import_the_guard_from_the_launch_directory(tmp_path):
    """The scripts name the middleware and put the launch directory (and it only) on PYTHONPATH; with
    PYTHONSAFEPATH the server's working directory (logs/<name>/) is not on its path. --no-auth: neither."""
    import dataclasses

    from llmcluster.serve.engine import Engine
    from llmcluster.serve.start import render_local, render_slurm

    job = serve_job(root=str(tmp_path / "root"))
    for text in (render_local(job), render_slurm(job, None, None)):
        server = next(ln for ln in text.splitlines() if "vllm.entrypoints.openai.api_server" in ln)
        assert server.removesuffix(" &").split()[-2:] == ["--middleware", "llmcluster_serve_guard.KeyGuard"]
        assert f"export PYTHONPATH={job.launch_dir}" in text.splitlines()
        assert "export PYTHONSAFEPATH=1" in text.splitlines()
    off = render_local(dataclasses.replace(job, auth=False))
    assert "--middleware" not in off and "PYTHONPATH" not in off
    # run by bash with a stand-in server: the shipped file is what `python -m` imports, from the launch directory
    fake = tmp_path / "server"
    fake.write_text("#!/bin/sh\nexec python3 -c 'import llmcluster_serve_guard as g, sys; print(g.__file__)'\n")
    fake.chmod(0o755)
    job = dataclasses.replace(job, engine=Engine(str(fake), "0", cpu=True))
    job.launch_dir.mkdir(parents=True)
    (job.logs / "api_key").write_text(KEY + "\n")
    (job.launch_dir / auth.GUARD_FILE).write_text(auth.guard_source())
    (job.logs / auth.GUARD_FILE).write_text("raise SystemExit('planted in the working directory')\n")
    out = subprocess.run(["bash", "-c", render_local(job)], capture_output=True, text=True, timeout=30,
                         cwd=job.logs)
    assert out.stdout.strip() == str(job.launch_dir / auth.GUARD_FILE), out


def test_serve_start_ships_the_guard_into_the_launch_directory(tmp_path, monkeypatch):
    """`serve start` writes the guard beside the artefact, read-only, before the job runs (local; Slurm the same;
    the Kubernetes ConfigMap: test_serve_start.py)."""
    from llmcluster.errors import RunFailure
    from llmcluster.serve import start

    job = serve_job(root=str(tmp_path / "root"))

    def submit(job, record, artifact):
        raise RunFailure("not run here")
    monkeypatch.setattr(start, "submit_local", submit)
    umask = os.umask(0o022)
    try:
        with pytest.raises(RunFailure):
            start.start(job, dry_run=False, timeout=1)
    finally:
        os.umask(umask)
    shipped = job.launch_dir / auth.GUARD_FILE
    assert shipped.read_text() == auth.guard_source() and shipped.stat().st_mode & 0o777 == 0o400
    assert sorted(p.name for p in job.launch_dir.iterdir()) == sorted(["launch.sh", auth.GUARD_FILE])
