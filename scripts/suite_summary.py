"""The end of `make test`: the machine's kind, each stream's wall time and its slowest tests, from the streams'
JUnit XML (pytest's --junitxml; a test's time there is its setup + call + teardown). Stdlib only: it runs
after the suite, whatever the venv holds.

    python scripts/suite_summary.py [--top N] [--tsv FILE] NAME=SECONDS=XML ...

--tsv writes every test's time (stream, wall seconds, node id, CPU seconds), to compare two machines or two trees
side by side. A test's CPU seconds (tests/conftest.py: its own and those of the processes it waited for) are what
it costs; on 2 shared cores its wall time is mostly its neighbours'.
"""

from __future__ import annotations

import argparse
import os
import platform
import xml.etree.ElementTree as ET


def machine() -> str:
    """The CPU and what decides the suite's speed on it: AVX-512, native bf16, the caps a run was given."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    kind = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    bf16 = "native bf16" if flags & {"avx512_bf16", "amx_bf16"} else "no native bf16"
    caps = ", ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ)
    return f"{model}, {os.cpu_count()} cores, {kind}, {bf16}" + (f" (capped: {caps})" if caps else "")


def tests(xml: str) -> list[tuple[float, str, float]]:
    """(wall seconds, node id, CPU seconds or -1 where the XML has none), slowest first."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cpu = next((p.get("value") for p in case.iter("property") if p.get("name") == "cpu_s"), None)
        out.append((float(case.get("time") or 0.0), node, float(cpu) if cpu is not None else -1.0))
    return sorted(out, reverse=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--tsv")
    ap.add_argument("streams", nargs="+", help="NAME=SECONDS=XML")
    a = ap.parse_args()
    print(f"\n=== make test on {machine()}")
    rows = []
    for spec in a.streams:
        name, seconds, xml = spec.split("=", 2)
        times = tests(xml)
        rows += [(name, t, node, cpu) for t, node, cpu in times]
        cpu_total = sum(max(cpu, 0.0) for _, _, cpu in times)
        print(f"--- {name}: {int(seconds) // 60} min {int(seconds) % 60:02d} s wall, {len(times)} tests, "
              f"{sum(t for t, _, _ in times):.0f} s of test time, {cpu_total:.0f} CPU s; "
              f"the {min(a.top, len(times))} slowest (wall, CPU):")
        for t, node, cpu in times[:a.top]:
            print(f"  {t:7.1f} s {cpu:7.1f} s  {node}")
        by_cpu = sorted(times, key=lambda x: -x[2])[:a.top]
        if by_cpu and by_cpu[0][2] > 0:
            print(f"    the {len(by_cpu)} costliest in CPU:")
            for t, node, cpu in by_cpu:
                print(f"  {t:7.1f} s {cpu:7.1f} s  {node}")
    if a.tsv:
        with open(a.tsv, "w") as f:
            f.writelines(f"{name}\t{t:.2f}\t{node}\t{cpu:.2f}\n" for name, t, node, cpu in rows)
        print(f"every test's time: {a.tsv}")


if __name__ == "__main__":
    main()
