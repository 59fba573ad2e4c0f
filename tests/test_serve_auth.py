"""The serving key's plumbing without an engine (issue 32): the key file, which key a client sends to which
endpoint, and that the harness gets it through its environment. The real server's 401/200 is in
test_serve_vllm.py (the session vLLM server)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmcluster.errors import UserError
from llmcluster.serve import auth


def serving_record(root: Path, name: str, endpoint: str, key: str | None) -> Path:
    logs = root / "logs" / name
    logs.mkdir(parents=True)
    (logs / "job.json").write_text(json.dumps({"run": name, "kind": "serve", "endpoint": endpoint}))
    if key:
        auth.write_key(logs, key)
    return logs


def test_the_key_file_is_private_and_replaces_what_was_planted(tmp_path):
    logs = tmp_path / "logs" / "srv"
    logs.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_text("theirs\n")
    (logs / "api_key").symlink_to(target)           # planted: the key must not be written through it
    key = auth.new_key()
    planted = logs / ".api_key.4"
    planted.write_text("planted")                    # a temp name someone made: never written, never removed
    path = auth.write_key(logs, key)
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert auth.read_key(path) == key and target.read_text() == "theirs\n" and len(key) >= 40
    assert planted.read_text() == "planted" and sorted(p.name for p in logs.iterdir()) == [".api_key.4", "api_key"]
    with pytest.raises(UserError, match="cannot write the API key file"):   # no folder to write it in: one line
        auth.write_key(target, "x")


def test_a_client_finds_the_key_of_the_record_of_its_endpoint(tmp_path):
    serving_record(tmp_path, "a", "http://127.0.0.1:8011/v1", "key-a")
    serving_record(tmp_path, "b", "http://127.0.0.1:8012/v1", "key-b")
    serving_record(tmp_path, "open", "http://127.0.0.1:8013/v1", None)      # --no-auth
    assert auth.key_for("http://127.0.0.1:8011/v1/completions", tmp_path, None) == "key-a"
    assert auth.key_for("http://127.0.0.1:8012", tmp_path, None) == "key-b"
    assert auth.key_for("http://127.0.0.1:8013/v1", tmp_path, None) is None
    assert auth.key_for("http://10.0.0.1:8011/v1", tmp_path, None) is None
    given = tmp_path / "k"
    given.write_text("from-file\n")
    assert auth.key_for("http://127.0.0.1:8011/v1", tmp_path, str(given)) == "from-file"
    given.write_text("two words\n")
    with pytest.raises(UserError, match="not an API key"):
        auth.key_for("http://127.0.0.1:8011/v1", tmp_path, str(given))
    with pytest.raises(UserError, match="cannot read it"):
        auth.key_for("http://127.0.0.1:8011/v1", tmp_path, str(tmp_path / "missing"))


def test_the_harness_gets_the_key_in_its_environment_only(tmp_path):
    """lm-eval's local-completions reads OPENAI_API_KEY: the key is there, not in its argv nor in the log."""
    from llmcluster.eval.harness import run_harness

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nenv > \"$ENV_DUMP\"\necho \"$@\" > \"$ENV_DUMP.argv\"\n"
                    "out=$(echo \"$@\" | sed 's/.*--output_path \\([^ ]*\\).*/\\1/')\n"
                    "mkdir -p \"$out/m\" && echo '{}' > \"$out/m/results_1.json\"\n")
    fake.chmod(0o755)
    os.environ["ENV_DUMP"] = str(tmp_path / "env")
    try:
        run_harness(str(fake), ["--model", "local-completions"], ["t"], tmp_path, tmp_path / "out",
                    tmp_path / "log", 1, None, api_key="s3cret-key")
    finally:
        del os.environ["ENV_DUMP"]
    assert "OPENAI_API_KEY=s3cret-key" in (tmp_path / "env").read_text().splitlines()
    assert "s3cret" not in (tmp_path / "env.argv").read_text() + (tmp_path / "log").read_text()


def test_eval_api_key_file_goes_with_endpoint(capsys, tmp_path):
    from conftest import assert_one_line_error, cli_inprocess

    p = cli_inprocess(capsys, "eval", "--model", "x", "--api-key-file", tmp_path / "k", "--root", tmp_path)
    assert_one_line_error(p, "--api-key-file goes with --endpoint")


@pytest.fixture
def listener():
    """An HTTP server on 127.0.0.1 that records every request's Authorization headers and answers 401."""
    import http.server
    import threading

    seen: list[list[str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            seen.append(self.headers.get_all("Authorization") or [])
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_a_key_file_is_opened_as_the_callers_own(tmp_path):
    """Issue 50: a symbolic link (to the caller's own secret), a FIFO, or a file of another uid is no key file of
    the caller's; an explicitly named --api-key-file may be a link (the caller chose it), but not a FIFO."""
    secret = tmp_path / "hf_token"
    secret.write_text("hf_victimsecret\n")
    link = tmp_path / "link"
    link.symlink_to(secret)
    with pytest.raises(UserError, match="symbolic link"):
        auth.read_key(link, own=True)
    assert auth.read_key(link) == "hf_victimsecret"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for own in (True, False):
        with pytest.raises(UserError, match="not a regular file"):
            auth.read_key(fifo, own=own)
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.write_text("k\n")
        os.chown(theirs, 4242, 4242)
        with pytest.raises(UserError, match="owned by uid 4242"):
            auth.read_key(theirs, own=True)


@pytest.mark.parametrize("command", ["serve bench", "eval"])
def test_a_planted_key_link_is_not_followed_nor_sent(tmp_path, capsys, listener, command):
    """Issue 50: a record in a shared logs/ whose endpoint is the attacker's listener and whose api_key links to
    the caller's HF token: `serve bench` and `eval --endpoint` sent `Authorization: Bearer hf_...` there. Now the
    link is refused (a warning line) and no header carries the token."""
    from conftest import cli_inprocess

    url, seen = listener
    secret = tmp_path / "hf_token"
    secret.write_text("hf_victimsecret\n")
    secret.chmod(0o600)
    logs = serving_record(tmp_path, "planted", f"{url}/v1", None)
    (logs / "api_key").symlink_to(secret)
    export = tmp_path / "models" / "m"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    (export / "tokenizer.json").write_text("{}")
    args = (["serve", "bench", "--endpoint", f"{url}/v1", "--requests", "1", "--concurrency", "1"]
            if command == "serve bench" else ["eval", "--endpoint", f"{url}/v1", "--name", "m"])
    p = cli_inprocess(capsys, *args, "--root", tmp_path)
    assert p.returncode != 0 and seen, (p, seen)
    assert not [h for headers in seen for h in headers if "hf_victimsecret" in h], seen
    assert "symbolic link" in p.stderr and "hf_victimsecret" not in p.stdout + p.stderr
