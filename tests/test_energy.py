"""Energy measured per GPU rank (issue 67): NVML's total-energy counter read at a rank's start, checkpoints and end
(monitor/energy.py), appended per rank under logs/<run>/energy/ (storage/energy.py), summed by `jobs goodput` and
the export's model card. No GPU here: the project's fake NVML (tests/monitor_helpers.py) stands in for pynvml."""

from __future__ import annotations

import json

import pynvml

from monitor_helpers import FakeNVML, fake_gpu
from llmcluster.launch.goodput import render, run_goodput
from llmcluster.monitor.energy import EnergyMeter
from llmcluster.storage.energy import run_energy
from llmcluster.storage.events import EVENTS


def nvml(*gpus: dict) -> FakeNVML:
    fake = FakeNVML(list(gpus))
    uuids = {g["uuid"]: i for i, g in enumerate(gpus)}
    fake.nvmlDeviceGetHandleByUUID = lambda u: uuids[u]   # the meter finds its GPU as CUDA names it
    return fake


def test_each_rank_records_what_its_gpu_drew_and_the_run_sums_them(tmp_path):
    nv = nvml(fake_gpu(0, energy_mj=1_000_000), fake_gpu(1, energy_mj=5_000_000))
    # CUDA's UUIDs come without NVML's "GPU-" prefix; rank 1's GPU is NVML's index 1 whatever CUDA calls it
    r0 = EnergyMeter(tmp_path, 0, "00000000-aaaa-bbbb-cccc-dddddddddddd", nvml=nv)
    r1 = EnergyMeter(tmp_path, 1, "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd", nvml=nv)
    assert r0.on and r1.on
    nv.gpus[0]["energy_mj"] += 2_000_000          # 2 kJ by the first checkpoint
    nv.gpus[1]["energy_mj"] += 3_000_000
    r0.record(1), r1.record()
    nv.gpus[0]["energy_mj"] += 1_000_000          # 3 kJ in all by the end (the counter is cumulative)
    r0.record(1), r1.record()
    assert run_energy(tmp_path) == {"joules": 6000.0, "kwh": 6000.0 / 3.6e6, "processes": 2, "ranks": 2}
    again = EnergyMeter(tmp_path, 0, "00000000-aaaa-bbbb-cccc-dddddddddddd", nvml=nv)   # a second attempt
    again.since += 1
    nv.gpus[0]["energy_mj"] += 500_000
    again.record(2)
    assert run_energy(tmp_path)["joules"] == 6500.0 and run_energy(tmp_path)["processes"] == 3
    line = json.loads((tmp_path / "energy" / "rank_0.jsonl").read_text().splitlines()[0])
    assert line["gpu"] == "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd" and line["attempt"] == 1


def test_no_nvml_or_no_counter_measures_nothing(tmp_path):
    off = [EnergyMeter(tmp_path, 0, None),   # a CPU rank
           EnergyMeter(tmp_path, 0, "u", nvml=FakeNVML([], init_error=pynvml.NVMLError_LibraryNotFound())),
           EnergyMeter(tmp_path, 0, "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd",
                       nvml=nvml(fake_gpu(0, energy_mj=pynvml.NVMLError_NotSupported())))]
    for meter in off:
        assert not meter.on
        meter.record(1)
    assert run_energy(tmp_path) is None and not (tmp_path / "energy").exists()


def test_a_malformed_line_is_skipped(tmp_path):
    (tmp_path / "energy").mkdir()
    (tmp_path / "energy" / "rank_0.jsonl").write_text(
        '{"t": 1, "since": 1, "rank": 0, "joules": 10}\n{"t": 2, "since": 1, "rank": 0, "joules": "lots"}\nnot json\n')
    assert run_energy(tmp_path)["joules"] == 10


def test_goodput_sums_the_energy_beside_the_time(tmp_path):
    logs = tmp_path / "logs" / "r"
    logs.mkdir(parents=True)
    (logs / EVENTS).write_text("".join(json.dumps(e) + "\n" for e in [
        {"t": 100.0, "attempt": 1, "event": "attempt_start", "step": 0},
        {"t": 101.0, "attempt": 1, "event": "init_done", "step": 0},
        {"t": 102.0, "attempt": 1, "event": "step", "step": 1},
        {"t": 103.0, "attempt": 1, "event": "exit", "step": 1, "reason": "completed"}]))
    assert run_goodput(tmp_path, "r")["energy"] is None
    nv = nvml(fake_gpu(0, energy_mj=0))
    meter = EnergyMeter(logs, 0, "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", nvml=nv)
    nv.gpus[0]["energy_mj"] = 7_200_000   # 7.2 kJ = 0.002 kWh
    meter.record(1)
    result = run_goodput(tmp_path, "r")
    assert result["energy"]["kwh"] == 0.002
    assert "energy: 0.002 kWh measured (NVML energy counters of 1 GPU rank process(es), 1 rank(s))" in render(result)


def test_the_card_gives_the_measured_energy_first():
    from llmcluster.export.card import energy

    out = energy({"device": "NVIDIA H100 80GB HBM3", "world_size": 8, "wall_s": 1800.0, "energy_j": 3.6e6})
    assert out["energy_kwh_measured"] == 1.0 and out["energy_note"].startswith("measured: NVML")
    assert out["energy_kwh_estimate"] is None
