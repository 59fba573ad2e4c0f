"""Deny by default: every route of the served engine needs the job's key, but the few a machine without it must
reach (issue 50). vLLM loads this as `--middleware llmcluster_serve_guard.KeyGuard`; `serve start` ships this
file, unchanged, under that name beside the job (the launch directory on PYTHONPATH locally and on Slurm, a
ConfigMap mounted read-only on Kubernetes), because the engine's venv and image have no llmcluster: it imports
the standard library only, and no ASGI framework.

vLLM's own guard (its `--api-key` / $VLLM_API_KEY AuthenticationMiddleware) covers /v1, /v2, /inference and
/cohere only; /invocations, /generative_scoring, /tokenize, /scale_elastic_ep and the rest answered anyone. Here
a request passes when its path is exactly one of OPEN or it carries `Authorization: Bearer <key>` (one such
header, the key compared in constant time); anything else, whatever the method (OPTIONS too), gets 401, and a
websocket is closed before it is accepted (403). The path is the one the client sent, not normalised: a path
that only routes like an open one ('/health/', '//health', '/metrics/x') needs the key too.
"""

import hashlib
import hmac
import os

KEY_ENV = "VLLM_API_KEY"
# what answers without the key, and why (docs/security.md "Served models answer only with the job's key"):
OPEN = frozenset({
    "/health",     # the probes: serve start's wait, the Slurm job's health loop, the kubelet's
    "/ping",       # the SageMaker-style health check (GET and POST) a load balancer sends
    "/metrics",    # Prometheus scrapes without the key (monitor config's jobs, the PodMonitor)
    "/version",    # the engine's version string only: what a client checks before it talks to it
})
_DENIED = b'{"error":"Unauthorized"}'


class KeyGuard:
    """Pure ASGI middleware (vLLM adds a class with `app.add_middleware(KeyGuard)`: the outermost layer)."""

    def __init__(self, app):
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(f"llmcluster_serve_guard: ${KEY_ENV} is empty: the server would answer no one")
        self.app = app
        self._digest = hashlib.sha256(key.encode("utf-8")).digest()

    def keyed(self, headers) -> bool:
        given = [v for k, v in headers if k.lower() == b"authorization"]
        if len(given) != 1:
            return False
        scheme, _, token = given[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token).digest(), self._digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") in OPEN \
                or self.keyed(scope.get("headers") or ()):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(_DENIED)).encode())]})
            await send({"type": "http.response.body", "body": _DENIED})
