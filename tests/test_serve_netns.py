"""`serve start` on a node of the namespace cluster (issue 51): bound to the node's own address (--host), reached
from a client node with the job's key, refused to the outsider (uid 65534, no key, cannot read the key file), and
every socket the serving node listens on named by docs/security.md's inventory."""

from __future__ import annotations

import json
import sys

import pytest

import inventory as inv
from conftest import VLLM_BASE, cli_env, run_cli, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
JOB, PORT = "ns-serve", 8000


def test_serve_start_on_a_node_answers_a_client_node_with_the_key_and_refuses_the_outsider(netcluster,
                                                                                            vllm_exports):
    c, root = netcluster, vllm_exports
    head, client = c.head, c.nodes[1]
    python = vllm_python()
    try:
        p = c.run(head, [sys.executable, "-m", "llmcluster", "serve", "start", "--model", VLLM_BASE, "--name", JOB,
                         "--root", root, "--scheduler", "local", "--engine-python", python, "--host", head.addr,
                         "--port", str(PORT)], env=cli_env(), timeout=900)
        log = root / "logs" / JOB / "server.log"
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr[-3000:]}\n{log.read_text()[-3000:] if log.exists() else ''}"
        assert f"endpoint http://{head.addr}:{PORT}/v1" in p.stdout
        key_file = root / "logs" / JOB / "api_key"
        key = key_file.read_text().strip()
        with_key = {"Authorization": f"Bearer {key}"}
        body = json.dumps({"model": VLLM_BASE, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        url = f"http://{head.fqdn}:{PORT}/v1"
        # a client node, by the head's FQDN, with the key
        assert c.http_status(client, f"{url}/models", headers=with_key) == 200
        assert c.http_status(client, f"{url}/completions", headers=with_key, post=body, timeout=120) == 200
        # the outsider reaches the port (the key, not a fence, guards it) and is refused without the key,
        # which it cannot read either
        assert c.http_status(c.outsider, f"{url}/models") == 401
        assert c.http_status(c.outsider, f"{url}/completions", post=body) == 401
        assert c.http_status(c.outsider, f"{url}/completions", post=body,
                             headers={"Authorization": "Bearer guessed"}) == 401
        cat = c.run(c.outsider, ["cat", str(key_file)])
        assert cat.returncode != 0 and key not in cat.stdout
        # nothing else on the serving node listens where the outsider gets in
        assert inv.check(c, head, "serve", {"--port": PORT}) == []
    finally:
        run_cli("jobs", "cancel", JOB, "--root", root)
