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
        auth.write_key(logs, key, 1)
    return logs


def test_the_key_file_is_private_and_replaces_what_was_planted(tmp_path):
    logs = tmp_path / "logs" / "srv"
    logs.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.write_text("theirs\n")
    (logs / "api_key").symlink_to(target)           # planted: the key must not be written through it
    key = auth.new_key()
    path = auth.write_key(logs, key, 3)
    assert not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
    assert auth.read_key(path) == key and target.read_text() == "theirs\n" and len(key) >= 40
    (logs / ".api_key.4").write_text("planted")      # the launch's own name exists: refused, not reused
    with pytest.raises(UserError, match="cannot create the API key file"):
        auth.write_key(logs, "x", 4)


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
