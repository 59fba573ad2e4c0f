"""Monitoring of serving jobs: `monitor config` finds vLLM endpoints in the serving jobs' records (or a flag),
scrapes them under one job with each job's name as a label, and writes each job's TTFT target as an alert rule
that the real promtool checks and unit-tests. The scrape of a real vLLM is in tests/test_serve_vllm.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import assert_one_line_error, run_cli
from monitor_helpers import MONITORING


def serving_record(root: Path, name: str, **rec) -> None:
    d = root / "logs" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "job.json").write_text(json.dumps({"run": name, "kind": "serve", "scheduler": "local", **rec}))


def rule_description(out: Path) -> str:
    return yaml.safe_load(Path(f"{out}.serve-slo.yml").read_text())["groups"][0]["rules"][0]["annotations"][
        "description"]


def serve_jobs(cfg: dict) -> list[dict]:
    return [j for j in cfg["scrape_configs"] if j["job_name"] == "llmcluster-serve"]


def test_config_scrapes_recorded_serving_jobs_and_flag_endpoints(tmp_path, storage):
    serving_record(storage, "chat", endpoint="http://gpu01:8000/v1", state="RUNNING", slo_ttft_p99_ms=500)
    serving_record(storage, "code", endpoint="http://10.0.0.7:8001/v1", state="RUNNING")
    serving_record(storage, "old", endpoint="http://gpu02:8000/v1", state="CANCELLED")       # ended: not scraped
    serving_record(storage, "starting", state="SUBMITTED")                                   # no endpoint yet
    serving_record(storage, "hostile", endpoint="http://a b\"}:80/v1\n- job_name: x", state="RUNNING")
    (storage / "logs" / "train-run").mkdir()
    (storage / "logs" / "train-run" / "job.json").write_text(json.dumps({"run": "train-run", "scheduler": "slurm"}))
    out = tmp_path / "prometheus.yml"
    proc = run_cli("monitor", "config", "--nodes", "gpu01", "--root", storage, "--serve-endpoints",
                   "http://infer.lab:9000/v1=ext", "--out", out, check=True)
    assert "3 serving endpoint(s)" in proc.stdout
    assert "starting has no endpoint" in proc.stderr and "hostile" in proc.stderr
    cfg = yaml.safe_load(out.read_text())
    (job,) = serve_jobs(cfg)
    assert job["static_configs"] == [
        {"targets": ["gpu01:8000"], "labels": {"serve_name": "chat"}},
        {"targets": ["10.0.0.7:8001"], "labels": {"serve_name": "code"}},
        {"targets": ["infer.lab:9000"], "labels": {"serve_name": "ext"}}]
    # the TTFT target of "chat" became a rule file beside the config, listed in rule_files
    slo = Path(cfg["rule_files"][-1])
    assert slo == out.with_name("prometheus.yml.serve-slo.yml").resolve()
    (rule,) = yaml.safe_load(slo.read_text())["groups"][0]["rules"]
    assert rule["alert"] == "ServingTTFTAboveSLO" and rule["labels"]["serve_name"] == "chat"
    assert rule["expr"] == 'llmcluster:serve_ttft_seconds:p99{serve_name="chat"} > 0.5'
    # without serving jobs nothing changes: no serve job, no extra rule file
    cfg = yaml.safe_load(run_cli("monitor", "config", "--nodes", "gpu01", "--root", tmp_path / "none",
                                 check=True).stdout)
    assert not serve_jobs(cfg) and len(cfg["rule_files"]) == 2


def test_config_serving_bad_input_is_one_line(tmp_path):
    for bad, needle in (("ftp://h:1/v1", "not http://HOST:PORT"), ("http://h/v1", "not http://HOST:PORT"),
                        ("http://h:99999/v1", "Port out of range"), (",", "at least one URL"),
                        ("http://h:80/v1=a\"b", "not a job name")):
        assert_one_line_error(run_cli("monitor", "config", "--nodes", "a", "--root", tmp_path,
                                      "--serve-endpoints", bad), needle)


def test_kubernetes_podmonitor_for_serving_pods_and_slo_rules_in_the_prometheusrule(storage):
    serving_record(storage, "chat", endpoint="http://chat.ns.svc:8000/v1", state="RUNNING", slo_ttft_p99_ms=800)
    docs = list(yaml.safe_load_all(run_cli("monitor", "config", "--kubernetes", "--root", storage,
                                           check=True).stdout))
    (pm,) = [d for d in docs if d["metadata"]["name"] == "llmcluster-serve"]
    assert pm["spec"]["selector"]["matchExpressions"][0]["key"] == "llmcluster.io/serve"
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert ep["path"] == "/metrics" and ep["relabelings"][1]["sourceLabels"] == [
        "__meta_kubernetes_pod_label_llmcluster_io_serve"]
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    slo = [g for g in rule["spec"]["groups"] if g["name"] == "llmcluster-serve-slo"]
    assert slo and slo[0]["rules"][0]["expr"].endswith("> 0.8")


@pytest.mark.prometheus
def test_promtool_checks_the_config_and_the_slo_alert_fires_only_above_its_target(tmp_path, storage):
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: bash scripts/install_system_deps.sh"
    serving_record(storage, "chat", endpoint="http://gpu01:8000/v1", state="RUNNING", slo_ttft_p99_ms=500)
    serving_record(storage, "code", endpoint="http://gpu02:8000/v1", state="RUNNING", slo_ttft_p99_ms=2000)
    out = tmp_path / "prometheus.yml"
    run_cli("monitor", "config", "--nodes", "gpu01", "--root", storage, "--out", out, check=True)
    p = subprocess.run([promtool, "check", "config", out], capture_output=True, text=True)
    assert p.returncode == 0 and "3 rule files found" in p.stdout + p.stderr, p.stdout + p.stderr
    # Both jobs' first tokens take ~1 s (all in the 0.5-1 s bucket, le=1): over chat's 500 ms, under code's 2 s.
    series = [{"series": f'vllm:time_to_first_token_seconds_bucket{{job="llmcluster-serve", serve_name="{name}", '
                         f'instance="x", le="{le}"}}', "values": f"0+{per_min}x30"}
              for name in ("chat", "code") for le, per_min in (("0.5", 0), ("1", 60), ("+Inf", 60))]
    summary = "p99 time to first token of chat is 995ms (target 500 ms)"
    test = tmp_path / "slo_test.yml"
    test.write_text(yaml.safe_dump({
        "rule_files": [str(MONITORING / "recording.yml"), f"{out}.serve-slo.yml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": "8m", "alertname": "ServingTTFTAboveSLO", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "ServingTTFTAboveSLO", "exp_alerts": [{
                "exp_labels": {"serve_name": "chat", "severity": "warning"},
                "exp_annotations": {"summary": summary, "description": rule_description(out)}}]}]}]}))
    p = subprocess.run([promtool, "test", "rules", test], capture_output=True, text=True)
    assert p.returncode == 0, test.read_text() + p.stdout + p.stderr
