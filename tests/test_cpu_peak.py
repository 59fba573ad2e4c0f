"""MFU's CPU denominator is the instruction set's peak (issue 69: a matmul timed under load gave MFU of 231% and
846%): cores x clock x FLOP per cycle from /proc/cpuinfo, checked on an AVX2, an AVX-512 and an AMX machine's
cpuinfo (tests/data/cpuinfo, SOURCE.md there), and a real run's MFU on this machine below 100%."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmcluster.config.cpus import isa_peak, physical_cores

CPUINFO = Path(__file__).parent / "data" / "cpuinfo"


def _info(name: str) -> str:
    return (CPUINFO / f"{name}.txt").read_text()


@pytest.mark.parametrize("name, threads, precision, flops, words", [
    ("avx2-zen3", 1, "fp32", 2445.412e6 * 32, "1 core x 2.45 GHz x 32 fp32 FLOP/cycle (AVX2+FMA)"),
    ("avx2-zen3", 8, "bf16", 8 * 2445.412e6 * 32, "8 cores x 2.45 GHz x 32 fp32 FLOP/cycle (AVX2+FMA)"),  # no bf16 unit
    ("avx512-icelake", 4, "fp32", 4 * 2.9e9 * 64, "4 cores x 2.90 GHz x 64 fp32 FLOP/cycle (AVX-512)"),
    ("avx512-icelake", 4, "bf16", 4 * 2.9e9 * 64, "64 fp32 FLOP/cycle (AVX-512)"),
    ("amx-sapphire", 2, "fp32", 2 * 2e9 * 64, "2 cores x 2.00 GHz x 64 fp32 FLOP/cycle (AVX-512)"),
    ("amx-sapphire", 2, "bf16", 2 * 2e9 * 1024, "2 cores x 2.00 GHz x 1024 bf16 FLOP/cycle (AMX); large matmuls"),
])
def test_the_isa_peak_is_cores_clock_and_the_widest_unit(name, threads, precision, flops, words):
    peak, how = isa_peak(_info(name), threads, precision)
    assert peak == pytest.approx(flops) and how.startswith("CPU ISA peak: ") and words in how, how


def test_threads_beyond_the_physical_cores_add_nothing_and_a_turbo_clock_counts():
    info = _info("avx2-zen3")
    assert physical_cores(info) == 64                       # `cpu cores` per socket, not the 128 threads listed
    assert isa_peak(info, 500)[0] == pytest.approx(64 * 2445.412e6 * 32)
    assert isa_peak(info, 1, max_mhz=3500)[0] == pytest.approx(3.5e9 * 32)   # cpufreq's maximum (boost)


def test_an_unknown_clock_or_unit_gives_no_peak_and_says_so():
    assert isa_peak("processor : 0\nflags : fpu\n", 1) == (0.0, isa_peak("", 1)[1])
    assert "MFU not computed" in isa_peak("processor : 0\ncpu MHz : 1000\nflags : fpu\n", 1)[1]


@pytest.mark.slow   # one short real run
def test_a_real_run_on_this_machine_reads_an_mfu_below_one(tiny_root):
    from conftest import overrides, run_cli

    run_cli("train", "-c", "llm_tiny", "--root", tiny_root,
            *overrides("run.name=mfu-bound", "train.steps=3", "log.interval=1"), check=True, timeout=300)
    path = tiny_root / "logs" / "mfu-bound" / "metrics.jsonl"
    mfus = [r["mfu"] for r in map(json.loads, path.read_text().splitlines()) if "mfu" in r]
    assert mfus and all(0 < m < 1 for m in mfus), mfus
