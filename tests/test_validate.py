"""`llmcluster validate` end to end on CPU: real gloo ranks, real files, the real CLI.

GPU-only checks must SKIP with their reason here; the acceptance figures (#wrong under a corrupted reduction,
storage GB/s, an injected slow node named as an outlier) are checked on what the commands actually measured and
wrote. No assertion depends on the machine's speed: the timing window is checked exactly on recorded timings in
test_validate_units.py, and busbw against a hand-timed loop is a benchmark (benchmarks/collectives_vs_handtimed.py).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error, cli_env, run_cli

WIDE = {"COLUMNS": "200"}


@pytest.mark.slow
def test_validate_all_runs_end_to_end_on_cpu(tmp_path):
    root = tmp_path / "storage"
    root.mkdir()
    proc = run_cli("validate", "all", "--quick", "-n", "2", "-w", "1", "--root", root, "--report", tmp_path / "r.json",
                   "--plot", tmp_path / "plots", env=cli_env(**WIDE), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    by_check = {c["check"]: c for c in doc["checks"]}
    assert set(by_check) >= {"stack", "collectives", "compute", "memory", "pcie", "storage", "thermal"}
    # GPU-only checks SKIP, and say why
    assert by_check["pcie"]["status"] == "SKIP" and "no CUDA device" in by_check["pcie"]["reason"]
    assert by_check["thermal"]["status"] == "SKIP" and "no CUDA device" in by_check["thermal"]["reason"]
    # collectives: two gloo ranks, every op, busbw reported, nothing wrong
    results = doc["results"]
    assert {r["op"] for r in results} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    assert by_check["collectives"]["data"]["world_size"] == 2
    assert all(r["busbw_GBps"] > 0 and r["time_us"] > 0 and r["wrong"] == 0 for r in results)
    assert {"op", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "wrong"} <= set(results[0])
    ar = [r for r in results if r["op"] == "all_reduce"]
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) for r in ar)   # 2(n-1)/n = 1 for n = 2
    # CPU figures measured, with numbers
    assert by_check["compute"]["data"]["shapes"][0]["tflops"] > 0
    assert by_check["memory"]["data"]["copy_GBps"] > 0
    area = by_check["storage"]["data"]["areas"][0]
    assert area["write_GBps"] > 0 and area["read_GBps"] > 0
    assert doc["environment"]["torch"].startswith("2.")
    for png in ("collectives_busbw.png",):
        assert (tmp_path / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # WARNs depend on the machine (e.g. Slurm client tools with the controller down); exit 0 means no FAIL
    assert doc["status"] in ("PASS", "WARN") and f"validate: {doc['status']}" in proc.stdout
    assert "busbw" in proc.stdout


def test_storage_on_a_tmp_dir_reports_write_and_read(tmp_path):
    run_cli("storage", "init", "--root", tmp_path / "s", check=True)
    proc = run_cli("validate", "storage", "--quick", "--storage-size", "16M", "--root", tmp_path / "s",
                   "--report", tmp_path / "s.json", env=cli_env(**WIDE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    areas = json.loads((tmp_path / "s.json").read_text())["checks"][0]["data"]["areas"]
    assert {a["area"] for a in areas} == {"datasets", "checkpoints", "logs", "models", "scratch"}
    for a in areas:
        assert a["bytes"] == 16 << 20 and a["write_GBps"] > 0 and a["read_GBps"] > 0 and a["create_per_s"] > 0
        assert a["read_method"] in ("O_DIRECT", "fadvise DONTNEED")
    assert "checkpoints write" in proc.stdout and "GB/s" in proc.stdout
    # said first (issue 34): a full run writes 2 GiB into each of 5 areas
    assert proc.stdout.splitlines()[0].startswith(
        f"storage: will write up to 16 MiB into each of 5 area(s) under {tmp_path / 's'} (80 MiB in all")
    assert not list((tmp_path / "s").rglob(".llmcluster-validate-*"))   # it cleans up after itself


def test_validate_all_says_what_storage_will_write_before_it_starts(tmp_path, monkeypatch):
    """Issue 34: `validate all` wrote 2 GiB per storage area (10 GiB) without a word; the plan line names it."""
    from collections import namedtuple

    from llmcluster.validate import storage

    run_cli("storage", "init", "--root", tmp_path / "s", check=True)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: usage(1 << 42, 0, 1 << 41))   # 2 TiB free
    line = storage.write_plan(tmp_path / "s", quick=False)
    assert "will write up to 2 GiB into each of 5 area(s)" in line and "(10 GiB in all" in line
    assert "64 MiB into each" in storage.write_plan(tmp_path / "s", quick=True)


@pytest.mark.slow
def test_injected_faults_are_caught_under_torchrun(tmp_path):
    """One 2-rank torchrun job, two injected faults: the last rank corrupts its reductions
    (LLMCLUSTER_VALIDATE_CORRUPT) and rank 1 reports a fifth of its compute/memory figures
    (LLMCLUSTER_VALIDATE_SLOW_RANK). The corrupted elements are counted, rank 1 is named as the outlier,
    and `--drain` drains its host with the reason."""
    # A stand-in scontrol that records its arguments: the real one would drain a node of the emulated
    # Slurm cluster other tests use.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "scontrol"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" >> {tmp_path}/scontrol.args\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = cli_env(LLMCLUSTER_TESTING="1", LLMCLUSTER_VALIDATE_CORRUPT="1", LLMCLUSTER_VALIDATE_SLOW_RANK="1",
                  PATH=f"{bindir}:{os.environ['PATH']}", PYTHONPATH=str(REPO), **WIDE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "llmcluster", "validate", "collectives", "compute", "memory", "--quick", "--drain",
           "-b", "64K", "-e", "64K", "-n", "2", "-w", "1", "--ops", "all_reduce,reduce_scatter,broadcast",
           "--report", str(tmp_path / "n.json"), "--plot", str(tmp_path / "plots")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-3000:]      # FAILs: wrong results and an outlier
    doc = json.loads((tmp_path / "n.json").read_text())
    # the hook damages every 1000th element of the last rank's reduction output
    wrong = {(r["op"], r["inplace"]): r["wrong"] for r in doc["results"]}
    assert wrong[("all_reduce", True)] == 17               # 16384 floats: elements 0, 1000, ..., 16000
    assert wrong[("reduce_scatter", False)] == wrong[("reduce_scatter", True)] == 9   # its 8192-float chunk
    assert wrong[("broadcast", True)] == 0                  # not a reduction: untouched
    assert "wrong elements" in proc.stdout
    nodes_check = next(c for c in doc["checks"] if c["check"] == "nodes")
    outliers = {(o["metric"], o["node"].split(":")[-1]) for o in nodes_check["data"]["outliers"]}
    assert outliers == {("compute fp32 TFLOP/s", "1"), ("memory copy GB/s", "1")}, nodes_check
    assert len({c["node"] for c in doc["checks"] if c["check"] == "compute"}) == 2   # gathered from both ranks
    args = (tmp_path / "scontrol.args").read_text().splitlines()
    assert args[:3] == ["update", f"nodename={doc['environment']['host']}", "state=drain"]
    assert len(args) == 4 and args[3].startswith("reason=llmcluster validate: compute fp32 TFLOP/s")
    for png in ("collectives_busbw.png", "nodes.png"):    # busbw curves and per-node bars
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


def test_stack_needs_no_torch():
    code = ("import sys; from llmcluster.cli import main; rc = main(['validate', 'stack']); "
            "print('TORCH', 'torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(**WIDE), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH False" in proc.stdout and "pytorch" in proc.stdout and "os / kernel" in proc.stdout


@pytest.mark.parametrize("args, needle", [
    (["bogus"], "unknown check 'bogus'"),
    (["collectives", "--ops", "all_reduce,allgather"], "unknown collective 'allgather'"),
    (["collectives", "-b", "64Q"], "bad size '64Q'"),
    (["collectives", "-b", "1M", "-e", "1K"], "bad size range"),
    (["collectives", "-f", "1"], "bad step factor"),
    (["collectives", "--nproc", "0"], "--nproc must be >= 1"),
])
def test_bad_input_is_one_line(args, needle):
    assert_one_line_error(run_cli("validate", *args), needle)


def test_bad_cluster_spec_is_one_line(tmp_path):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("validate:\n  min_busbw: 300\n")
    assert_one_line_error(run_cli("validate", "stack", "--cluster", spec), "unknown key 'validate.min_busbw'",
                          "did you mean 'validate.min_busbw_GBps'")
    assert_one_line_error(run_cli("validate", "stack", "--cluster", tmp_path / "nope.yaml"), "not found")


@pytest.mark.slow
def test_collectives_as_srun_tasks_gather_on_rank_0(tmp_path):
    """Two processes with only the variables srun sets (plus MASTER_ADDR/PORT from the batch script),
    on loopback: the same command a 2-node `srun` runs."""
    from conftest import free_port

    port = str(free_port())
    spec = tmp_path / "cluster.yaml"   # this test is about gathering, not speed: no outliers on a busy box
    spec.write_text("validate:\n  tolerance: 0.9\n")
    procs = []
    for rank in (0, 1):
        env = cli_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                      SLURMD_NODENAME=f"node{rank}", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **WIDE)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID"):
            env.pop(k, None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "llmcluster", "validate", "collectives", "memory", "--quick", "-b", "64K",
             "-e", "256K", "--ops", "all_reduce,all_gather", "--cluster", str(spec), "--report", str(tmp_path / f"r{rank}.json")],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert not (tmp_path / "r1.json").exists()          # only rank 0 reports
    doc = json.loads((tmp_path / "r0.json").read_text())
    assert {r["op"] for r in doc["results"]} == {"all_reduce", "all_gather"}
    assert all(r["wrong"] == 0 for r in doc["results"])
    assert {c["node"] for c in doc["checks"] if c["check"] == "memory"} == {"node0:0", "node1:1"}
    assert "validate:" in outs[0] and "validate:" not in outs[1]
