"""Monitor against Debian's real Prometheus/promtool: config and rule checks, alert unit tests, and an
end-to-end scrape of `monitor serve` and a training process's metrics port, read back over the HTTP API.

These must run in CI (`make test` installs the `prometheus` package): a missing promtool fails, never skips.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from conftest import REPO, cli_env, free_port, run_cli
from monitor_helpers import DASHBOARDS, MONITORING, dashboard_queries, http_get_json

pytestmark = pytest.mark.prometheus


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install Debian's prometheus package (bash scripts/install_system_deps.sh)")
    return path


def promtool(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120)


# ---- static checks ------------------------------------------------------------------------------------
def test_promtool_check_rules():
    p = promtool("check", "rules", MONITORING / "recording.yml", MONITORING / "alerts.yml")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout


def test_promtool_unit_tests_pass_and_every_alert_fires_and_stays_silent():
    p = promtool("test", "rules", "alerts_test.yml", cwd=MONITORING / "tests")
    assert p.returncode == 0, p.stdout + p.stderr
    alerts = {r["alert"] for g in yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    fires, silent = set(), set()
    for t in yaml.safe_load((MONITORING / "tests" / "alerts_test.yml").read_text())["tests"]:
        for a in t["alert_rule_test"]:
            (fires if a.get("exp_alerts") else silent).add(a["alertname"])
    assert alerts == fires == silent, (alerts - fires, alerts - silent)


def test_promtool_unit_tests_catch_a_broken_rule(tmp_path):
    """The unit tests can fail: loosen one threshold and promtool must report that alert."""
    shutil.copytree(MONITORING, tmp_path / "m", ignore=shutil.ignore_patterns("grafana"))
    alerts = tmp_path / "m" / "alerts.yml"
    alerts.write_text(alerts.read_text().replace("DCGM_FI_DEV_GPU_TEMP >= 84", "DCGM_FI_DEV_GPU_TEMP >= 60"))
    p = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path / "m" / "tests")
    assert p.returncode != 0 and "GPUTemperatureHigh" in p.stdout + p.stderr


@pytest.mark.parametrize("source", [("--nodes", "gpu01,gpu02"), ("--slurm-nodelist", "gpu[01-16]")])
def test_promtool_check_config_of_generated_scrape_configs(tmp_path, source):
    out = tmp_path / "prometheus.yml"
    run_cli("monitor", "config", *source, "--train-ports-per-node", "8", "--out", out, check=True)
    p = promtool("check", "config", out)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rule files found" in p.stdout + p.stderr


# ---- end to end: a real Prometheus scraping the exporter and a trainer -------------------------------------
class Prometheus:
    def __init__(self, config: Path, data: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(data.parent / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> dict:
        return http_get_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))

    def wait_for(self, expr: str, timeout: float = 90, what: str = "") -> list:
        """Poll until the instant query returns a non-empty vector."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.logtail()}")
            try:
                last = self.query(expr)
                if last["status"] == "success" and last["data"]["result"]:
                    return last["data"]["result"]
            except OSError as e:  # not listening yet
                last = str(e)
            time.sleep(0.2)
        raise AssertionError(f"no result for {what or expr} in {timeout}s: {last}; log: {self.logtail()}")

    def logtail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-2000:]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


STAND_IN_TRAINER = textwrap.dedent("""
    # A stand-in training loop: the real TrainMetrics class on a real port, steps every 0.2 s.
    import sys, time
    from llmcluster.monitor.train_metrics import TrainMetrics
    m = TrainMetrics("e2e-run", 0, int(sys.argv[1]))
    print(m.port, flush=True)
    step = 0
    while True:
        step += 1
        m.step(step, 5.0 / step, 3e-4, 1000.0 + step, 0.2, 0.2)
        m.rank_step_times([0.2, 0.21])
        if step % 10 == 0:
            m.checkpoint(step, 0.05, time.time())
        time.sleep(0.2)
""")


@pytest.fixture
def exporter(storage):
    p = subprocess.Popen([sys.executable, "-m", "llmcluster", "monitor", "serve", "--port", "0", "--root",
                          str(storage), "--expected-gpus", "0"], cwd=REPO, env=cli_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    m = re.search(r"127\.0\.0\.1:(\d+)/metrics", line)
    assert m, (line, p.stderr.read() if p.poll() is not None else "")
    yield int(m.group(1))
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=10)


def start_prometheus(tmp_path, node_port: int, train_port: int) -> Prometheus:
    # The config is the one `monitor config` writes (rules included), with a 1 s scrape interval.
    cfg = tmp_path / "prometheus.yml"
    run_cli("monitor", "config", "--nodes", "127.0.0.1", "--port", node_port, "--train-port", train_port,
            "--scrape-interval", "1s", "--out", cfg, check=True)
    return Prometheus(cfg, tmp_path / "tsdb")


def check_node_metrics_and_rules(prom: Prometheus, storage: Path):
    up = prom.wait_for('up{job="llmcluster-node"} == 1', what="exporter scraped")
    assert up[0]["metric"]["instance"].startswith("127.0.0.1:")
    cpus = prom.wait_for("llmcluster_node_cpus")
    assert float(cpus[0]["value"][1]) >= 1
    areas = prom.wait_for('llmcluster_storage_size_bytes{job="llmcluster-node"}')
    assert {r["metric"]["area"] for r in areas} == {"datasets", "checkpoints", "logs", "models", "scratch"}
    assert {r["metric"]["path"] for r in areas} == {str(storage / a) for a in
                                                   ("datasets", "checkpoints", "logs", "models", "scratch")}
    ratio = prom.wait_for('llmcluster:storage_bytes_used:ratio{area="checkpoints"}', what="recording rule")
    assert 0 <= float(ratio[0]["value"][1]) <= 1
    prom.wait_for("llmcluster:node_cpu_busy:ratio", what="CPU recording rule (needs two scrapes)")


def check_rules_healthy_and_dashboards_evaluate(prom: Prometheus):
    rules = http_get_json(f"{prom.url}/api/v1/rules")["data"]["groups"]
    assert {g["name"] for g in rules} >= {"llmcluster-recording", "llmcluster-gpu", "llmcluster-node",
                                           "llmcluster-train"}
    bad = [(r["name"], r.get("lastError")) for g in rules for r in g["rules"] if r["health"] == "err"]
    assert not bad, bad
    firing = prom.query('ALERTS{alertstate="firing"}')["data"]["result"]
    assert not firing, firing  # a healthy loopback "cluster": nothing fires
    for path in DASHBOARDS:
        for expr in dashboard_queries(path):
            q = (expr.replace("$Hostname", ".*").replace("$instance", ".*").replace("$run", "e2e-run")
                 .replace('="', '=~"'))
            r = prom.query(q)
            assert r["status"] == "success", (path.name, expr, r)


def test_end_to_end_prometheus_scrapes_exporter_and_training_metrics(tmp_path, storage, exporter):
    trainer = subprocess.Popen([sys.executable, "-c", STAND_IN_TRAINER, str(free_port())], cwd=REPO,
                               env=cli_env(PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True)
    prom = None
    try:
        train_port = int(trainer.stdout.readline())
        prom = start_prometheus(tmp_path, exporter, train_port)
        check_node_metrics_and_rules(prom, storage)
        tps = prom.wait_for('llmcluster_train_tokens_per_second{run="e2e-run"} > 0', what="training throughput")
        assert tps[0]["metric"]["job"] == "llmcluster-train" and tps[0]["metric"]["rank"] == "0"
        prom.wait_for('llmcluster_train_rank_step_time_seconds{run="e2e-run", rank="1"}')
        prom.wait_for('llmcluster_train_checkpoint_age_seconds{run="e2e-run"} >= 0', what="checkpoint age")
        check_rules_healthy_and_dashboards_evaluate(prom)
    finally:
        if prom:
            prom.stop()
        trainer.kill()
        trainer.wait()


@pytest.mark.slow
def test_end_to_end_with_a_real_llm_tiny_training_run(tmp_path, storage, exporter):
    """The real trainer (`llmcluster train`, preset llm_tiny shrunk to run fast on 2 shared cores) serving
    log.metrics_bind, scraped by a real Prometheus next to `monitor serve`."""
    src = tmp_path / "src"
    shutil.copytree(REPO / "llmcluster" / "monitor", src, ignore=shutil.ignore_patterns("__pycache__"))
    run_cli("data", "prepare", "--root", storage, "--name", "tiny", "--source", src, "--tokenizer", "byte",
            check=True)
    port = free_port()
    tiny = ["model.n_layers=1", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
            "model.vocab_size=257", "data.dataset=tiny", "data.seq_len=32", "train.micro_batch=2",
            "train.steps=100000", "train.warmup_steps=1", "train.precision=fp32", "log.interval=1",
            "log.eval_interval=100000", "checkpoint.interval_steps=100000", "run.name=e2e-tiny",
            f"log.metrics_bind=127.0.0.1:{port}"]
    log = open(tmp_path / "train.log", "w")
    trainer = subprocess.Popen([sys.executable, "-m", "llmcluster", "train", "--config", "llm_tiny", "--root",
                                str(storage), *[a for kv in tiny for a in ("--set", kv)]],
                               cwd=REPO, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
    prom = start_prometheus(tmp_path, exporter, port)
    try:
        check_node_metrics_and_rules(prom, storage)
        tps = prom.wait_for('llmcluster_train_tokens_per_second{run="e2e-tiny"} > 0', timeout=240,
                            what=f"training throughput (trainer log: {tmp_path / 'train.log'})")
        assert tps[0]["metric"] | {"instance": "-"} == {"__name__": "llmcluster_train_tokens_per_second",
                                                       "run": "e2e-tiny", "rank": "0", "job": "llmcluster-train",
                                                       "instance": "-"}
        step = prom.wait_for('llmcluster_train_step{run="e2e-tiny"} >= 1')
        loss = float(prom.wait_for('llmcluster_train_loss{run="e2e-tiny"}')[0]["value"][1])
        assert float(step[0]["value"][1]) >= 1 and 0 < loss < 10  # byte-level cross-entropy: ln(257) = 5.5
        prom.wait_for('llmcluster_train_rank_step_time_seconds{run="e2e-tiny", rank="0"} > 0')
    finally:
        trainer.send_signal(signal.SIGTERM)  # the trainer checkpoints and exits 75 (requeue me)
        try:
            trainer.wait(timeout=120)
        finally:
            if trainer.poll() is None:
                trainer.kill()
            prom.stop()
            log.close()
    assert trainer.returncode == 75, (tmp_path / "train.log").read_text()[-3000:]  # EXIT_PREEMPTED
