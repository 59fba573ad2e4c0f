"""The end of `make test`: the machine's kind, each stream's wall time and its slowest tests, from the streams'
JUnit XML (pytest's --junitxml; a test's time there is its setup + call + teardown). Stdlib only: it runs
after the suite, whatever the venv holds.

    python scripts/suite_summary.py [--top N] [--tsv FILE] NAME=SECONDS=XML ...

--tsv writes every test's time (stream, seconds, node id), to compare two machines or two trees side by side.
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


def tests(xml: str) -> list[tuple[float, str]]:
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out.append((float(case.get("time") or 0.0), node))
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
        rows += [(name, t, node) for t, node in times]
        print(f"--- {name}: {int(seconds) // 60} min {int(seconds) % 60:02d} s wall, {len(times)} tests, "
              f"{sum(t for t, _ in times):.0f} s of test time; the {min(a.top, len(times))} slowest:")
        for t, node in times[:a.top]:
            print(f"  {t:7.1f} s  {node}")
    if a.tsv:
        with open(a.tsv, "w") as f:
            f.writelines(f"{name}\t{t:.2f}\t{node}\n" for name, t, node in rows)
        print(f"every test's time: {a.tsv}")


if __name__ == "__main__":
    main()
