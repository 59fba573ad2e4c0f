"""Monitor without Prometheus: TrainMetrics over real HTTP, the NVML->dcgm mapping (fake NVML, no GPU here),
`monitor serve/config/watch` as subprocesses, dashboards and rules naming only metrics we export."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pynvml
import pytest
import yaml
from prometheus_client import generate_latest

from conftest import REPO, assert_one_line_error, cli_env, free_port, run_cli
from monitor_helpers import (DASHBOARDS, MONITORING, PROMETHEUS_BUILTINS, FakeNVML, dashboard_queries,
                                  exported_metric_names, fake_gpu, families, promql_metric_names,
                                  recording_rule_names, VLLM_METRICS)

from llmcluster.errors import UserError
from llmcluster.monitor.exporter import build_registry
from llmcluster.monitor.nvml_metrics import GPU_METRIC_NAMES
from llmcluster.config.hostlist import expand_hostlist
from llmcluster.monitor.train_metrics import TrainMetrics


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return families(r.read().decode())


def value(fams, name, **labels) -> float:
    found = [s.value for s in fams.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, fams.get(name))
    return found[0]


# ---- TrainMetrics ---------------------------------------------------------------------------------------
def test_train_metrics_served_over_http_with_run_and_rank_labels():
    m = TrainMetrics("tiny-run", 0, port=0)
    try:
        assert m.port and m.port > 0
        m.step(12, 2.5, 3e-4, 4321.0, 0.41, 0.25)
        m.rank_step_times([0.25, 0.40, 0.26])
        m.straggler(1)
        t0 = time.time()
        m.checkpoint(10, 1.5, finished_at=t0 - 100)
        m.bad_step(); m.bad_step()
        f = scrape(m.port)
        me = {"run": "tiny-run", "rank": "0"}
        assert value(f, "llmcluster_train_step", **me) == 12
        assert value(f, "llmcluster_train_loss", **me) == 2.5
        assert value(f, "llmcluster_train_learning_rate", **me) == 3e-4
        assert value(f, "llmcluster_train_tokens_per_second", **me) == 4321.0
        assert value(f, "llmcluster_train_mfu", **me) == 0.41
        assert value(f, "llmcluster_train_step_time_seconds", **me) == 0.25
        assert value(f, "llmcluster_train_bad_steps_total", **me) == 2
        assert value(f, "llmcluster_train_straggler_rank", **me) == 1
        assert value(f, "llmcluster_train_checkpoint_step", **me) == 10
        assert value(f, "llmcluster_train_checkpoint_duration_seconds", **me) == 1.5
        assert "llmcluster_train_checkpoint_interval_seconds" not in f  # one checkpoint: no interval yet
        # the label rank of the per-rank step time is the measured rank, not the publisher's
        assert [value(f, "llmcluster_train_rank_step_time_seconds", run="tiny-run", rank=str(r))
                for r in range(3)] == [0.25, 0.40, 0.26]
        assert abs(value(f, "llmcluster_train_last_step_timestamp_seconds", **me) - time.time()) < 60
        # the age is computed when scraped, so it grows without any call from the trainer
        age1 = value(f, "llmcluster_train_checkpoint_age_seconds", **me)
        assert 100 <= age1 < 160
        time.sleep(1.1)
        age2 = value(scrape(m.port), "llmcluster_train_checkpoint_age_seconds", **me)
        assert age2 >= age1 + 1
        m.checkpoint(20, 2.0, finished_at=t0)
        m.straggler(None)
        m.step(13, float("nan"), 3e-4, 4000.0, 0.4, 0.3)
        f = scrape(m.port)
        assert value(f, "llmcluster_train_checkpoint_interval_seconds", **me) == pytest.approx(100)
        assert value(f, "llmcluster_train_straggler_rank", **me) == -1
        assert math.isnan(value(f, "llmcluster_train_loss", **me))
    finally:
        m.close()
    with pytest.raises(OSError):  # closed: the port no longer answers
        socket.create_connection(("127.0.0.1", m.port), timeout=1).close()


def test_train_metrics_without_port_serves_nothing_and_two_instances_do_not_collide():
    a, b = TrainMetrics("a", 0, None), TrainMetrics("a", 1, None)  # same run, same process: no clash
    for m in (a, b):
        m.step(1, 1.0, 1e-3, 10.0, 0.1, 0.5); m.checkpoint(1, 0.1, time.time()); m.bad_step(); m.straggler(-1)
        m.close()
    assert a.port is None and b.port is None
    text = generate_latest(b.registry).decode()
    assert 'llmcluster_train_step{rank="1",run="a"} 1.0' in text
    assert "python_gc" not in text  # own registry: not the process collector's metrics


def test_train_metrics_port_in_use_is_a_user_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); s.listen()
        with pytest.raises(UserError, match="cannot serve training metrics on 127.0.0.1"):
            TrainMetrics("r", 0, s.getsockname()[1])


def test_monitor_modules_do_not_import_torch():
    code = ("import sys, llmcluster.monitor.train_metrics, llmcluster.monitor.exporter, "
            "llmcluster.monitor.watch, llmcluster.monitor.scrape_config, llmcluster.cli; "
            "llmcluster.cli.build_parser(); print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- NVML -> dcgm-exporter names (fake NVML: no GPU on CI) ----------------------------------------------
def test_nvml_readings_map_to_dcgm_exporter_names_labels_and_units(tmp_path):
    not_supported = pynvml.NVMLError_NotSupported()
    nv = FakeNVML([fake_gpu(0), fake_gpu(1, ecc=not_supported, temp=86)])
    nv.events.append(type("Ev", (), {"device": 1, "eventData": 79})())
    registry, gpus, _ = build_registry(None, 2, nvml=nv, hostname="gpu-node-7")
    assert gpus.error is None and gpus.count == 2 and nv.registered == [0, 1]
    f = families(generate_latest(registry).decode())
    g0 = {"gpu": "0", "UUID": "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", "pci_bus_id": "00000000:18:00.0",
          "device": "nvidia0", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-node-7"}
    labels = [s.labels for s in f["DCGM_FI_DEV_GPU_UTIL"]]
    assert labels[0] == g0 and labels[1]["gpu"] == "1" and labels[1]["device"] == "nvidia1"
    assert value(f, "DCGM_FI_DEV_GPU_UTIL", gpu="0") == 97
    assert value(f, "DCGM_FI_DEV_MEM_COPY_UTIL", gpu="0") == 40
    assert value(f, "DCGM_FI_DEV_GPU_TEMP", gpu="1") == 86
    assert value(f, "DCGM_FI_DEV_MEMORY_TEMP", gpu="0") == 50
    assert value(f, "DCGM_FI_DEV_POWER_USAGE", gpu="0") == pytest.approx(350.123)     # mW -> W
    assert value(f, "DCGM_FI_DEV_FB_USED", gpu="0") == 60 * 1024                      # bytes -> MiB
    assert value(f, "DCGM_FI_DEV_FB_FREE", gpu="0") == 20 * 1024
    assert value(f, "DCGM_FI_DEV_SM_CLOCK", gpu="0") == 1980
    assert value(f, "DCGM_FI_DEV_MEM_CLOCK", gpu="0") == 2619
    assert value(f, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu="0") == 123456789
    assert value(f, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", gpu="0") == 0x44
    # NVML counts violation time in ns, DCGM in us; policy order POWER=0, THERMAL=1, ...
    assert value(f, "DCGM_FI_DEV_POWER_VIOLATION", gpu="0") == 2_000_000
    assert value(f, "DCGM_FI_DEV_THERMAL_VIOLATION", gpu="0") == 4_000_000
    assert value(f, "DCGM_FI_DEV_RELIABILITY_VIOLATION", gpu="0") == 12_000_000
    assert value(f, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", gpu="0") == 3
    assert value(f, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", gpu="0") == 1
    assert value(f, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", gpu="0") == 2
    assert value(f, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", gpu="0") == 1
    assert value(f, "DCGM_FI_DEV_ROW_REMAP_FAILURE", gpu="0") == 0
    # ECC not supported on GPU 1: absent for it, not a made-up 0
    assert [s.labels["gpu"] for s in f["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"]] == ["0"]
    # the XID event for GPU 1 is drained at scrape time and sticks as its last XID
    assert value(f, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 79 and value(f, "DCGM_FI_DEV_XID_ERRORS", gpu="0") == 0
    f2 = families(generate_latest(registry).decode())
    assert value(f2, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == 79
    assert value(f, "llmcluster_node_gpus_present") == 2 and value(f, "llmcluster_node_nvml_up") == 1
    nv.gpus[1]["fb_total"] = pynvml.NVMLError_GpuIsLost()  # GPU 1 falls off the bus while we run
    f3 = families(generate_latest(registry).decode())
    assert value(f3, "llmcluster_node_gpus_present") == 1 and value(f3, "llmcluster_node_gpus_expected") == 2
    assert [s.labels["gpu"] for s in f3["DCGM_FI_DEV_FB_USED"]] == ["0"]
    # the names are dcgm-exporter's (etc/default-counters.csv) and every one we declare is exported
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_XID_ERRORS",
            "DCGM_FI_DEV_ROW_REMAP_FAILURE"} <= set(GPU_METRIC_NAMES)
    assert set(GPU_METRIC_NAMES) <= set(f)
    gpus.close()
    assert nv.shutdown


def test_a_non_nvml_exception_skips_one_reading_not_the_scrape():
    # fake NVML (no GPU on CI): GPU 0's utilisation struct comes back as something the binding cannot read
    nv = FakeNVML([fake_gpu(0, util=ValueError("bad struct")), fake_gpu(1)])
    registry, gpus, _ = build_registry(None, 2, nvml=nv, hostname="n1")
    for scrape in (1, 2):
        f = families(generate_latest(registry).decode())
        assert [s.labels["gpu"] for s in f["DCGM_FI_DEV_GPU_UTIL"]] == ["1"]      # only the bad reading is gone
        assert value(f, "DCGM_FI_DEV_GPU_TEMP", gpu="0") == 45 and value(f, "llmcluster_node_gpus_present") == 2
        assert value(f, "llmcluster_nvml_read_errors", gpu="0", metric="DCGM_FI_DEV_GPU_UTIL") == scrape
    assert {s.labels["metric"] for s in f["llmcluster_nvml_read_errors"]} == {   # the two read from that call
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL"}
    gpus.close()


def test_framebuffer_used_leaves_reserved_memory_out_with_v2_and_falls_back_to_v1():
    # fake NVML: GPU 0 has a driver with nvmlDeviceGetMemoryInfo_v2 (512 MiB reserved), GPU 1 an older one
    nv = FakeNVML([fake_gpu(0, fb_reserved=512 * 2**20), fake_gpu(1, fb_reserved=pynvml.NVMLError_FunctionNotFound())])
    registry, gpus, _ = build_registry(None, 2, nvml=nv, hostname="n1")
    f = families(generate_latest(registry).decode())
    assert value(f, "DCGM_FI_DEV_FB_USED", gpu="0") == 60 * 1024 - 512
    assert value(f, "DCGM_FI_DEV_FB_FREE", gpu="0") == 20 * 1024
    assert value(f, "DCGM_FI_DEV_FB_TOTAL", gpu="0") == 80 * 1024
    assert value(f, "DCGM_FI_DEV_FB_USED", gpu="1") == 60 * 1024               # v1: reserved counted as used
    assert "llmcluster_nvml_read_errors" not in f
    gpus.close()


def test_without_nvml_the_node_metrics_are_served_and_gpus_reported_absent(storage):
    nv = FakeNVML([], init_error=pynvml.NVMLError_LibraryNotFound())
    registry, gpus, _ = build_registry(storage, 8, nvml=nv)
    assert gpus.count == 0 and "NVML unavailable" in gpus.error
    f = families(generate_latest(registry).decode())
    assert not any(n.startswith("DCGM_") for n in f)
    assert value(f, "llmcluster_node_nvml_up") == 0
    assert value(f, "llmcluster_node_gpus_present") == 0 and value(f, "llmcluster_node_gpus_expected") == 8
    st = os.statvfs(storage / "checkpoints")
    assert value(f, "llmcluster_storage_size_bytes", area="checkpoints") == st.f_blocks * st.f_frsize
    assert value(f, "llmcluster_storage_files", area="checkpoints") == st.f_files
    assert {s.labels["area"] for s in f["llmcluster_storage_size_bytes"]} == {
        "datasets", "checkpoints", "logs", "models", "scratch"}
    assert 0 < value(f, "llmcluster_node_memory_available_bytes") <= value(f, "llmcluster_node_memory_total_bytes")
    assert value(f, "llmcluster_node_cpu_seconds_total", mode="idle") > 0


# ---- monitor serve ----------------------------------------------------------------------------------------
def listening_addresses(port: int) -> list[str]:
    """IPv4 addresses with a listening socket on `port`, from /proc/net/tcp (no traffic sent)."""
    found = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":
            found.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found


def start_serve(*args, env=None) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-m", "llmcluster", "monitor", "serve", "--port", "0", *map(str, args)],
                         cwd=REPO, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert "serving http://127.0.0.1:" in line, (line, p.stderr.read() if p.poll() is not None else "")
    return p, int(line.split("127.0.0.1:")[1].split("/")[0])


def test_serve_takes_expected_gpus_and_root_from_the_cluster_spec(storage, tmp_path):
    spec = tmp_path / "cluster.yaml"
    me = socket.gethostname().split(".")[0]
    spec.write_text(f"nodes: {{hosts: [{me}, other1], overrides: {{{me}: {{gpus_per_node: 3}}}}}}\n"
                    f"hardware: {{gpu: H100, gpus_per_node: 8}}\nstorage: {{root: {storage}}}\n")
    p, port = start_serve("--cluster", spec)
    try:
        f = scrape(port)
        assert value(f, "llmcluster_node_gpus_expected") == 3            # this host's override, not the 8
        assert value(f, "llmcluster_storage_size_bytes", area="logs", path=str(storage / "logs")) > 0
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0


def test_serve_exposes_node_and_storage_metrics_on_loopback_and_stops_on_sigterm(storage):
    p, port = start_serve("--root", storage, "--expected-gpus", 2)
    try:
        f = scrape(port)
        assert value(f, "llmcluster_node_gpus_expected") == 2
        assert value(f, "llmcluster_node_nvml_up") == 0  # no driver on this machine
        assert value(f, "llmcluster_storage_size_bytes", area="logs", path=str(storage / "logs")) > 0
        assert value(f, "llmcluster_node_cpus") == os.cpu_count()
        assert listening_addresses(port) == ["127.0.0.1"]  # loopback only unless told otherwise
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0


def test_serve_bad_input_is_one_line(tmp_path):
    assert_one_line_error(run_cli("monitor", "serve", "--root", tmp_path / "nope"), "does not exist")
    assert_one_line_error(run_cli("monitor", "serve", "--port", "0", "--expected-gpus", "-1"), "--expected-gpus")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); s.listen()
        assert_one_line_error(run_cli("monitor", "serve", "--port", s.getsockname()[1]), "cannot listen on")


# ---- monitor config ---------------------------------------------------------------------------------------
def test_config_static_nodes_slurm_nodelist_and_cluster_spec(tmp_path):
    cfg = yaml.safe_load(run_cli("monitor", "config", "--nodes", "gpu01,gpu02", "--train-ports-per-node", "2",
                                 check=True).stdout)
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    assert jobs == {"llmcluster-node": ["gpu01:9400", "gpu02:9400"],
                    "llmcluster-train": ["gpu01:9401", "gpu01:9402", "gpu02:9401", "gpu02:9402"]}
    assert [os.path.basename(f) for f in cfg["rule_files"]] == ["recording.yml", "alerts.yml"]
    out = tmp_path / "prom.yml"
    run_cli("monitor", "config", "--slurm-nodelist", "gpu[08-10,12]", "--train-port", "-1",
            "--scrape-interval", "5s", "--out", out, check=True)
    cfg = yaml.safe_load(out.read_text())
    assert cfg["global"]["scrape_interval"] == "5s" and len(cfg["scrape_configs"]) == 1
    assert cfg["scrape_configs"][0]["static_configs"][0]["targets"] == [
        "gpu08:9400", "gpu09:9400", "gpu10:9400", "gpu12:9400"]
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: {hosts: [a1, 'b[1-2]', c9]}\nhardware: {gpu: H100, gpus_per_node: 2}\n"
                    "monitoring: {exporter_port: 9500}\n")
    cfg = yaml.safe_load(run_cli("monitor", "config", "--cluster", spec, check=True).stdout)
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    assert jobs["llmcluster-node"] == ["a1:9500", "b1:9500", "b2:9500", "c9:9500"]
    assert jobs["llmcluster-train"][:2] == ["a1:9401", "a1:9402"]    # one trainer port per GPU (local rank)
    spec.write_text("nodes: {hosts: 'g[1-2]', overrides: {g2: {gpus_per_node: 1}}}\n"
                    "hardware: {gpu: H100, gpus_per_node: 2}\n")
    cfg = yaml.safe_load(run_cli("monitor", "config", "--cluster", spec, check=True).stdout)
    assert cfg["scrape_configs"][1]["static_configs"][0]["targets"] == ["g1:9401", "g1:9402", "g2:9401"]
    spec.write_text("nodes: {hosts: [a1, 'b[1-2]', c9]}\nhardware: {gpu: H100, gpus_per_node: 2}\n")
    # no --cluster: ./cluster.yaml, as every command resolves it
    cfg = yaml.safe_load(run_cli("monitor", "config", "--port", "9400", cwd=tmp_path, check=True).stdout)
    assert cfg["scrape_configs"][0]["static_configs"][0]["targets"][0] == "a1:9400"


def test_config_bad_input_is_one_line(tmp_path):
    assert_one_line_error(run_cli("monitor", "config", "--slurm-nodelist", "gpu[3-1]"), "descending range")
    assert_one_line_error(run_cli("monitor", "config", "--slurm-nodelist", "gpu[a-b]"), "bad range")
    assert_one_line_error(run_cli("monitor", "config", "--nodes", "a", "--scrape-interval", "15"), "Prometheus duration")
    assert_one_line_error(run_cli("monitor", "config", "--nodes", "a", "--port", "70000"), "--port")
    assert_one_line_error(run_cli("monitor", "config", "--cluster", tmp_path / "missing.yaml"), "not found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: {a: 1}\n")
    assert_one_line_error(run_cli("monitor", "config", "--cluster", bad), "nodes.a")
    bad.write_text("nodes: {count: 4}\nhardware: {gpu: H100, gpus_per_node: 8}\n")  # a count, no names
    assert_one_line_error(run_cli("monitor", "config", "--cluster", bad), "4 node(s) but no host names")
    bad.write_text("cluster:\n  gpu: H100\n  hosts: gpu[1-2]\n")               # the old format
    assert_one_line_error(run_cli("monitor", "config", "--cluster", bad), "old cluster format")
    assert_one_line_error(run_cli("monitor", "config", cwd=tmp_path), "no cluster spec", "--nodes")


@pytest.mark.parametrize("expr", ["gpu[01-03,7],login,n[8-10]", "node1", "a[098-101]", "x[1,3,5-6]"])
def test_hostlist_expansion_matches_slurm(expr, tmp_path):
    scontrol = shutil.which("scontrol")
    if scontrol is None:  # Slurm comes with `make test`'s system deps; compare against it when present
        pytest.skip("scontrol not installed")
    # scontrol reads a slurm.conf before anything else, even to expand a hostlist: a minimal one of our own,
    # so the comparison does not depend on whether a test Slurm was brought up earlier in the session.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    ours = expand_hostlist(expr)
    theirs = subprocess.run([scontrol, "show", "hostnames", expr], capture_output=True, text=True, check=True,
                            env={**os.environ, "SLURM_CONF": str(conf)}).stdout.split()
    assert ours == theirs


def test_kubernetes_manifests_validate_and_carry_the_rules():
    import kubernetes_validate

    docs = list(yaml.safe_load_all(run_cli("monitor", "config", "--kubernetes", "--expected-gpus", "8",
                                           check=True).stdout))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["DaemonSet", "PodMonitor", "PodMonitor", "PodMonitor", "PrometheusRule"]
    kubernetes_validate.validate(docs[0], "1.30", strict=True)
    c = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["monitor", "serve"] and c["args"][-2:] == ["--expected-gpus", "8"]
    assert c["ports"][0]["name"] == docs[1]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # the alerts match on job names; the operator's default would be "<namespace>/<podmonitor>"
    jobs = [d["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["replacement"] for d in docs[1:4]]
    assert jobs == ["llmcluster-node", "llmcluster-train", "llmcluster-serve"]
    ours = {g["name"] for f in ("recording.yml", "alerts.yml")
            for g in yaml.safe_load((MONITORING / f).read_text())["groups"]}
    assert {g["name"] for g in docs[4]["spec"]["groups"]} == ours


# ---- monitor watch ----------------------------------------------------------------------------------------
def test_watch_once_shows_node_storage_and_training_and_marks_dead_targets(storage):
    p, port = start_serve("--root", storage, "--expected-gpus", 4)
    m = TrainMetrics("watch-run", 0, 0)
    try:
        m.step(77, 1.2345, 1e-3, 5678.0, 0.123, 0.5)
        m.straggler(3)
        dead = free_port()
        env = cli_env(COLUMNS="200")
        proc = run_cli("monitor", "watch", "--once", "--targets", f"127.0.0.1:{port},127.0.0.1:{m.port},127.0.0.1:{dead}",
                       env=env)
        out = proc.stdout
        # one target DOWN fails the check (issue 69: exit 0 while a training target was DOWN), the rest still shown
        assert proc.returncode == 1 and f"1 of 3 target(s) DOWN: 127.0.0.1:{dead}" in proc.stderr, proc.stderr
        assert "watch-run" in out and "77" in out and "1.2345" in out and "5678" in out and "12.3" in out
        assert "rank 3" in out
        assert "0/4" in out and "absent" in out          # GPUs present/expected, NVML absent
        assert "checkpoints" in out and "scratch" in out
        assert f"127.0.0.1:{dead}" in out and "DOWN" in out
        all_dead = run_cli("monitor", "watch", "--once", "--targets", f"127.0.0.1:{dead}", env=env)
        assert all_dead.returncode == 1 and "DOWN" in all_dead.stdout
    finally:
        m.close()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)
    assert_one_line_error(run_cli("monitor", "watch", "--once", "--targets", ","), "--targets")


# ---- dashboards and rules name only metrics we export ---------------------------------------------------
def test_promql_metric_name_extractor():
    assert promql_metric_names('rate(DCGM_FI_DEV_THERMAL_VIOLATION{gpu="0"}[5m]) / 1e6') == {
        "DCGM_FI_DEV_THERMAL_VIOLATION"}
    assert promql_metric_names('max by (run, rank) (a_b) / on(run) group_left quantile by (run) (0.5, c:d:e)'
                               ) == {"a_b", "c:d:e"}
    assert promql_metric_names("count(up == 0) or vector(0)") == {"up"}
    assert promql_metric_names("time() - x_seconds offset 5m > 15 * 60") == {"x_seconds"}


def test_grafana_dashboards_are_valid_and_query_only_exported_metrics(storage):
    known = exported_metric_names(storage) | recording_rule_names() | PROMETHEUS_BUILTINS | VLLM_METRICS
    assert len(DASHBOARDS) == 4
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)) and ids
        assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in d["templating"]["list"])
        for p in d["panels"]:
            assert p["datasource"]["uid"] == "${datasource}", (path.name, p["title"])
            gp = p["gridPos"]
            assert gp["x"] + gp["w"] <= 24 and p["targets"], (path.name, p["title"])
        used = set().union(*(promql_metric_names(e) for e in dashboard_queries(path)))
        assert used and used <= known, (path.name, sorted(used - known))


def test_alert_and_recording_rules_read_only_exported_metrics(storage):
    known = exported_metric_names(storage) | recording_rule_names() | PROMETHEUS_BUILTINS | VLLM_METRICS
    for f in ("recording.yml", "alerts.yml"):
        for g in yaml.safe_load((MONITORING / f).read_text())["groups"]:
            for r in g["rules"]:
                used = promql_metric_names(r["expr"])
                assert used and used <= known, (f, r.get("alert", r.get("record")), sorted(used - known))


def test_real_nvml_on_a_gpu_machine():
    """The real NVML path, on a machine with a GPU (skipped on CPU-only machines, where NVML cannot load)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        pytest.skip(f"no NVML here: {e}")
    pynvml.nvmlShutdown()
    registry, gpus, _ = build_registry(None, None)
    try:
        f = families(generate_latest(registry).decode())
        assert gpus.count >= 1 and len(f["DCGM_FI_DEV_GPU_TEMP"]) == gpus.count
        smi = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        for i, line in enumerate(smi):
            uuid, total_mib = (x.strip() for x in line.split(","))
            assert value(f, "DCGM_FI_DEV_FB_TOTAL", UUID=uuid) == pytest.approx(float(total_mib), rel=0.01)
            assert 0 < value(f, "DCGM_FI_DEV_GPU_TEMP", UUID=uuid) < 120
            assert value(f, "DCGM_FI_DEV_POWER_USAGE", UUID=uuid) > 0
    finally:
        gpus.close()


def test_watch_shows_a_run_before_its_first_step_and_refuses_a_target_that_is_no_host_port():
    """Issue 53: a starting run (metrics served, no step yet) had no row; `--targets garbage` was a DOWN row."""
    m = TrainMetrics("fresh-run", 0, 0)
    try:
        out = run_cli("monitor", "watch", "--once", "--targets", f"127.0.0.1:{m.port}",
                      env=cli_env(COLUMNS="200"), check=True).stdout
        assert "fresh-run" in out and "starting" in out, out
    finally:
        m.close()
    assert_one_line_error(run_cli("monitor", "watch", "--once", "--targets", "garbage"), "'garbage' is not HOST:PORT")
