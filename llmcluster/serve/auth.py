"""The API key of a serving job (issue 32): one per job, a file logs/<name>/api_key (mode 0600) that vLLM reads at
run time through $VLLM_API_KEY (never a command line, never a rendered artefact, never `jobs status`); on Kubernetes
a Secret <name>-api-key. Clients (`serve start`'s smoke request, `serve bench`, `eval --endpoint`) take
--api-key-file, else the key of the serving record whose endpoint is the one they were given.

vLLM's own guard covers /v1 (and /v2, /inference, /cohere) only: serve start adds guard.py's KeyGuard
(`--middleware`), shipped beside the job under GUARD_FILE, so every route but /health, /ping, /metrics and
/version needs the key (issue 50; docs/security.md).

A key found through a serving record is opened as the caller's own: not through a symbolic link (O_NOFOLLOW,
lstat), a regular file, owned by the caller's uid; anything else is not sent (issue 50: a planted api_key link to
the caller's HF token was sent as a Bearer to whoever wrote the record).
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path
from urllib.parse import urlsplit

from llmcluster.errors import UserError
from llmcluster.storage.owned import read_text, replace_atomically

KEY_FILE = "api_key"
ENV = "VLLM_API_KEY"              # what vLLM reads
CLIENT_ENV = "OPENAI_API_KEY"     # what lm-eval's local-completions and `vllm bench serve` read
SECRET_KEY = "api-key"            # the key's entry in the Kubernetes Secret
GUARD_MODULE = "llmcluster_serve_guard"       # guard.py as the engine imports it (it has no llmcluster)
GUARD_FILE = f"{GUARD_MODULE}.py"
MIDDLEWARE = f"{GUARD_MODULE}.KeyGuard"       # vLLM's --middleware


def guard_source() -> str:
    """guard.py's text, shipped unchanged as GUARD_FILE."""
    return Path(__file__).with_name("guard.py").read_text(encoding="utf-8")


def new_key() -> str:
    return secrets.token_urlsafe(32)


def write_key(logs: Path, key: str) -> Path:
    """logs/<name>/api_key, a fresh key per start: written to a fresh name created 0600 with O_EXCL (never a file
    someone else planted, never readable by others for an instant), then renamed over the old one (a symlink
    planted at api_key is replaced, not followed): storage/owned.replace_atomically."""
    path = logs / KEY_FILE
    try:
        replace_atomically(path, key + "\n", 0o600)
    except OSError as e:
        raise UserError(f"cannot write the API key file {path}: {e.strerror or e}") from None
    return path


def read_key(path: Path | str, what: str = "--api-key-file", own: bool = False) -> str:
    # storage/owned.py's reading: a regular file, not blocking on a FIFO; `own`: no link, the caller's uid
    text, why = read_text(Path(path), own=own, follow=not own)
    if text is None:
        raise UserError(f"{what} {path}: cannot read it ({why or 'no such file'})")
    key = text[:64 * 1024].strip()
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise UserError(f"{what} {path}: not an API key (one line without spaces)")
    return key


def _base(url: str) -> str:
    """An endpoint as scheme://host:port (what /v1, /v1/completions and a trailing / leave the same)."""
    u = urlsplit(url.strip())
    return f"{u.scheme}://{u.netloc}".lower()


def key_for(endpoint: str, root: Path | None, key_file: str | None) -> str | None:
    """The key to send to `endpoint`: --api-key-file's, else that of the serving record (logs/*/job.json, kind
    serve) whose endpoint matches and whose key file is there; None when neither (a server without a key)."""
    if key_file:
        return read_key(key_file)
    if root is None or not (Path(root) / "logs").is_dir():
        return None
    want = _base(endpoint)
    for rec_file in sorted((Path(root) / "logs").glob("*/job.json")):
        try:
            rec = json.loads(rec_file.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if not isinstance(rec, dict) or rec.get("kind") != "serve" or not isinstance(rec.get("endpoint"), str):
            continue
        if _base(rec["endpoint"]) != want:
            continue
        key = rec_file.parent / KEY_FILE
        if not (key.is_symlink() or key.exists()):     # a --no-auth job's record
            continue
        # our own key file only: a record someone else wrote into a shared logs/ gets no say in what we send
        try:
            return read_key(key, "the serving job's key file", own=True)
        except UserError as e:
            print(f"warning: {e}: no key sent", file=sys.stderr)
    return None


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}
