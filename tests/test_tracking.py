"""Experiment tracking (issue 28): one training run, launched through the local scheduler, logs to W&B
(offline), MLflow (a SQLite store on this node) and TensorBoard besides metrics.jsonl. Each sink is read
back with its own library's reader and must hold the same steps and values as metrics.jsonl, the resolved
config and the code version `git describe` gave at launch."""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, run_cli
from faultkit import make_dataset, sets, train_env
from llmcluster.monitor.tracking import scalars

pytestmark = pytest.mark.slow
# mlflow and wandb are imported where a test reads their stores, not here: importing mlflow costs every xdist worker
# ~5 s of CPU at collection, for `make test-fast` too. The test extra installs both: a missing one fails, never skips.

OVER = dict(train__steps=6, checkpoint__interval_steps=3, log__interval=2, log__eval_interval=3,
            log__tensorboard=True, log__wandb__project="llmcluster-test", log__mlflow__experiment="track")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    root = make_dataset(tmp_path_factory.mktemp("tracking") / "storage")
    store = root.parent / "node-local" / "mlflow.db"      # beside the storage root, not under it
    store.parent.mkdir()
    uri = f"sqlite:///{store}"
    env = train_env(WANDB_MODE="offline", WANDB_SILENT="true")
    p = subprocess.run([sys.executable, "-m", "llmcluster", "launch",
                        "--scheduler", "local", "-c", "llm_tiny", "--root", str(root),
                        *sets(**OVER, run__name="tracked", log__mlflow__tracking_uri=uri)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    logs = root / "logs" / "tracked"
    records = [json.loads(ln) for ln in (logs / "metrics.jsonl").read_text().splitlines()]
    return {"root": root, "logs": logs, "uri": uri, "records": records,
            "want": {r["step"]: scalars(r) for r in records}}


def git_describe() -> str:
    return subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--tags"],
                          capture_output=True, text=True, check=True).stdout.strip()


def assert_same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel: float = 0.0):
    assert sorted(got) == sorted(want)
    for step, values in want.items():
        assert set(got[step]) == set(values), (step, set(got[step]) ^ set(values))
        for k, v in values.items():
            assert math.isclose(got[step][k], v, rel_tol=rel, abs_tol=rel * 1e-3), (step, k, got[step][k], v)


def test_run_records_config_code_version_and_versions(tracked):
    info = json.loads((tracked["logs"] / "run.json").read_text())
    job = json.loads((tracked["logs"] / "job.json").read_text())
    assert job["code_version"] == git_describe() == info["code_version"]
    assert info["config"]["train"]["steps"] == 6 and info["config"]["log"]["wandb"]["project"] == "llmcluster-test"
    assert info["torch"] and info["package_version"] and len(info["dataset_digest"]) == 64
    # the eval cadence: log.eval_interval and the last step
    assert [r["step"] for r in tracked["records"] if "val_loss" in r] == [3, 6]
    assert [r["step"] for r in tracked["records"]] == [2, 3, 4, 6]


def test_tensorboard_holds_the_jsonl_values(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked["logs"] / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            got.setdefault(e.step, {})[tag] = e.value
    assert_same(got, tracked["want"], rel=1e-6)     # TensorBoard stores float32
    text = acc.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert git_describe() in text and '"steps": 6' in text


def read_wandb_log(path: Path) -> list:
    """The records of an offline run's transaction log (run-<id>.wandb). The format is LevelDB's log
    (32 KiB blocks of records with 7-byte headers) behind a 7-byte W&B header; wandb 0.2x dropped its
    Python reader, so the test reads it with the protobuf classes wandb ships."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):   # block trailer / padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):      # FULL or LAST fragment
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_offline_wandb_holds_the_jsonl_values_summary_and_config(tracked):
    runs = list((tracked["logs"] / "wandb").glob("offline-run-*/run-tracked.wandb"))
    assert len(runs) == 1, runs
    recs = read_wandb_log(runs[0])
    kind = lambda r: r.WhichOneof("record_type")  # noqa: E731
    got: dict[int, dict[str, float]] = {}
    for r in recs:
        if kind(r) == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            got[items["_step"]] = {k: float(v) for k, v in items.items() if not k.startswith("_")}
    assert_same(got, tracked["want"])
    summary: dict[str, float] = {}
    for r in recs:
        if kind(r) == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.summary.update})
    last = tracked["records"][-1]
    assert summary["_step"] == last["step"] and summary["loss"] == last["loss"]
    assert summary["val_loss"] == last["val_loss"]
    config = {u.key: json.loads(u.value_json) for r in recs if kind(r) == "run" for u in r.run.config.update}
    assert config["code_version"] == git_describe() and config["config"]["train"]["steps"] == 6
    assert [r.exit.exit_code for r in recs if kind(r) == "exit"] == [0]


def test_mlflow_holds_the_jsonl_values_config_and_code_version(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracked["uri"])
    exp = client.get_experiment_by_name("track")
    (run,) = client.search_runs([exp.experiment_id], "tags.`llmcluster.run` = 'tracked'")
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    assert_same(got, tracked["want"])
    assert run.data.tags["code_version"] == git_describe() and run.info.status == "FINISHED"
    assert run.data.params["config.train.steps"] == "6" and run.data.params["dataset"] == "t"


def test_mlflow_sqlite_on_the_storage_root_is_refused(tracked):
    root = tracked["root"]
    p = run_cli("train", "-c", "llm_tiny", "--root", root,
                *sets(run__name="x", log__mlflow__tracking_uri=f"sqlite:///{root}/logs/mlflow.db"))
    assert_one_line_error(p, "SQLite")


def test_mlflow_uri_with_credentials_is_refused(tmp_path):
    """The config is copied into the launch directory and every sink: a secret in the URI would leak."""
    p = run_cli("train", "-c", "llm_tiny", "--root", tmp_path, "--set", "log.mlflow.tracking_uri=https://u:pw@mlflow/")
    assert_one_line_error(p, "log.mlflow.tracking_uri", "MLFLOW_TRACKING_PASSWORD")
    assert "pw" not in p.stderr.replace("PASSWORD", "")


def test_eval_results_reach_the_runs_sinks(tracked, tmp_path):
    """`llmcluster eval`'s record goes to the sinks the run logged to: TensorBoard and the training run's MLflow
    run at the checkpoint's step, W&B (offline) as an eval run grouped with it. On a copy of the run, so the
    tests above keep comparing the training metrics alone."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llmcluster.monitor.tracking import log_eval

    root = tmp_path / "storage"
    shutil.copytree(tracked["root"], root)
    db = tmp_path / "node-local" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(tracked["uri"].removeprefix("sqlite:///"), db)
    logs = root / "logs" / "tracked"
    info = json.loads((logs / "run.json").read_text())
    info["config"]["log"]["mlflow"]["tracking_uri"] = f"sqlite:///{db}"
    (logs / "run.json").write_text(json.dumps(info))
    record = {"run": "tracked", "step": 6, "tasks": {"llmc_stdlib_mc": {"metrics": {"acc": 0.3125, "acc_norm": 0.25}},
                                                     "llmc_stdlib_ppl": {"metrics": {"bits_per_byte": 3.5}}}}
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert log_eval(root, logs, record) == ["tensorboard", "mlflow", "wandb"]
    want = {"eval/llmc_stdlib_mc/acc": 0.3125, "eval/llmc_stdlib_mc/acc_norm": 0.25,
            "eval/llmc_stdlib_ppl/bits_per_byte": 3.5}

    acc = EventAccumulator(str(logs / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert {k: [(e.step, e.value) for e in acc.Scalars(k)] for k in want} == {k: [(6, v)] for k, v in want.items()}

    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("track").experiment_id],
                                "tags.`llmcluster.run` = 'tracked'")
    for k, v in want.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] == [(6, v)]
    assert run.info.status == "FINISHED"          # the training run's status is left as it was

    (ev,) = list((logs / "wandb").glob("offline-run-*/run-tracked-eval.wandb"))
    hist = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in read_wandb_log(ev) if r.WhichOneof("record_type") == "history"]
    assert len(hist) == 1 and hist[0]["checkpoint_step"] == 6
    assert {k: hist[0][k] for k in want} == want
    # a record of something that is not one of our runs (no run.json) is logged nowhere
    assert log_eval(root, root / "logs" / "elsewhere", record) == []
