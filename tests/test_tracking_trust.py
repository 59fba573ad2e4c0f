"""Credentials never follow a directory (issue 32, Medium #4/#5): `eval` sends its results (and with them the
caller's tracking credentials) only to the sinks of a run.json the caller owns; a run name is never pasted into
MLflow's search as text that could change the filter; a tracking URI carrying a credential is refused when the
config is validated, before anything is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmcluster.monitor.tracking import find_mlflow_run, log_eval
from test_eval import CountingListener   # a planted tracking server: counts the connections it is offered

RECORD = {"run": "r", "step": 6, "tasks": {"t": {"metrics": {"acc": 0.5}}}}


def _run_json(logs: Path, run: str, log: dict) -> Path:
    logs.mkdir(parents=True, exist_ok=True)
    p = logs / "run.json"
    p.write_text(json.dumps({"run": run, "config": {"log": log}}))
    return p


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_run_json_owned_by_someone_else_sends_nothing(tmp_path, monkeypatch):
    planted = CountingListener()
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "caller-secret")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    logs = tmp_path / "logs" / "r"
    p = _run_json(logs, "r", {"tensorboard": True, "mlflow": {"tracking_uri": planted.url, "experiment": "e"}})
    os.chown(p, 65534, 65534)
    said = []
    try:
        assert log_eval(tmp_path, logs, RECORD, say=said.append) == []
    finally:
        planted.sock.close()
    assert planted.count == 0
    assert not (logs / "tensorboard").exists()
    assert len(said) == 1 and "owned by uid 65534" in said[0] and str(p) in said[0]


def test_a_linked_run_json_is_not_followed(tmp_path):
    elsewhere = _run_json(tmp_path / "mine", "r", {"tensorboard": True})
    logs = tmp_path / "logs" / "r"
    logs.mkdir(parents=True)
    (logs / "run.json").symlink_to(elsewhere)
    said = []
    assert log_eval(tmp_path, logs, RECORD, say=said.append) == [] and not (logs / "tensorboard").exists()
    assert len(said) == 1 and "cannot be read" in said[0]


def test_a_run_name_with_a_quote_does_not_reach_the_search(tmp_path):
    """MLflow's filter grammar has no escape: `a' OR ...` would change the filter. Such a name is not one of
    ours, is never searched, and the sinks are skipped with one line."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e")
    other = client.create_run(exp, tags={"llmcluster.run": "victim"})
    hostile = "x' OR tags.`llmcluster.run` = 'victim"
    assert find_mlflow_run(client, exp, hostile) is None
    assert find_mlflow_run(client, exp, "victim").info.run_id == other.info.run_id
    logs = tmp_path / "logs" / "r"
    _run_json(logs, hostile, {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "e"}})
    said = []
    assert log_eval(tmp_path, logs, RECORD, say=said.append) == []
    assert len(said) == 1 and "not a run name" in said[0]
    assert client.get_metric_history(other.info.run_id, "eval/t/acc") == []


@pytest.mark.parametrize("uri,named", [
    ("  http://u:pw-secret@mlflow:5000/", "user:password@"),          # leading blanks hid it from a regex
    ("\thttps://u:pw-secret@mlflow/", "user:password@"),
    ("postgresql://db/mlflow?password=pw-secret", "'password'"),
    ("http://mlflow/?sslmode=require&API_KEY=pw-secret", "'API_KEY'"),
    ("https://mlflow/?X-Amz-Signature=pw-secret", "'X-Amz-Signature'"),
])
def test_a_tracking_uri_with_a_credential_is_refused_naming_secret_env(capsys, tmp_path, uri, named):
    """Refused when the config is validated (before run.json, the launch directory or a sink is written),
    naming job.secret_env (job.env refuses secret names) and never echoing the secret."""
    from conftest import assert_one_line_error, cli_inprocess

    cfg = tmp_path / "job.yaml"
    cfg.write_text(json.dumps({"run": {"name": "cred"}, "log": {"mlflow": {"tracking_uri": uri}}}))
    proc = cli_inprocess(capsys, "train", "-c", str(cfg), "--root", tmp_path / "storage")
    assert_one_line_error(proc, "log.mlflow.tracking_uri", named, "job.secret_env")
    assert "pw-secret" not in proc.stderr + proc.stdout
    assert "job.env " not in proc.stderr and not (tmp_path / "storage").exists()


def test_a_plain_tracking_uri_is_kept_stripped():
    from llmcluster.config import load_job_config
    from llmcluster.config.schema import MlflowConfig

    assert MlflowConfig(tracking_uri="  http://mlflow:5000/?sslmode=require ").tracking_uri == \
        "http://mlflow:5000/?sslmode=require"
    assert load_job_config(None, ["log.mlflow.tracking_uri=sqlite:////tmp/m.db"]).log.mlflow.tracking_uri == \
        "sqlite:////tmp/m.db"
