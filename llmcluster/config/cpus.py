"""The CPU's peak for MFU: cores × clock × FLOP per cycle of its widest vector unit, a pure function of
/proc/cpuinfo (issue 69). MFU on CPU used to divide by a matmul timed at start-up; on a loaded machine that reading
was far low (a 2-thread product on two busy cores ran ~70× below the 1-thread figure) and runs printed MFU of 231% and
846%. An instruction-set peak is a bound the rank cannot pass, so MFU against it stays at or below 100%.

FLOP per cycle per core, fp32, counting an FMA as 2 and two FMA pipes (Intel since Haswell and Skylake-SP, AMD
since Zen 2; a core with one pipe reaches half, and reads half the MFU): SSE2 8, AVX 16, AVX2+FMA 32, AVX-512 64.
bf16/fp16 where the CPU has them natively: AVX512_BF16's dot product doubles the fp32 figure; AMX does 1024 bf16
FLOP per cycle per core (Intel's Sapphire Rapids optimisation manual). Without them the trainer computes in fp32
(distributed/process_groups.native_low_precision), and so is the peak. Clock: the highest `cpu MHz` listed, or the
cpufreq maximum where the kernel exposes one (turbo); a VM that shows only its nominal clock reads MFU a little high.
No torch here: the planner and head-node tools can read it too."""

from __future__ import annotations

from pathlib import Path

FP32_FLOP_PER_CYCLE = (("avx512f", 64, "AVX-512"), ("fma", 32, "AVX2+FMA"), ("avx", 16, "AVX"), ("sse2", 8, "SSE2"))
AMX_BF16_FLOP_PER_CYCLE = 1024
CPUFREQ_MAX = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")   # kHz


def _fields(cpuinfo: str) -> tuple[list[dict[str, str]], set[str]]:
    """Every processor's `key: value` lines, and the first one's flags."""
    procs, cur = [], {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if cur:
                procs.append(cur)
            cur = {}
            continue
        key, _, value = line.partition(":")
        cur[key.strip()] = value.strip()
    if cur:
        procs.append(cur)
    return procs, set(procs[0].get("flags", "").split()) if procs else set()


def physical_cores(cpuinfo: str) -> int:
    """Cores, not hyperthreads (two threads of a core share its vector pipes): per socket `cpu cores` × sockets,
    else the processors listed."""
    procs, _ = _fields(cpuinfo)
    try:
        sockets = {p.get("physical id", "0") for p in procs}
        return max(1, int(procs[0]["cpu cores"]) * len(sockets))
    except (KeyError, ValueError, IndexError):
        return max(1, len(procs))


def isa_peak(cpuinfo: str, threads: int, precision: str = "fp32", max_mhz: float | None = None) -> tuple[float, str]:
    """(FLOP/s, how it was counted) for `threads` threads of one process: min(threads, physical cores) × clock ×
    FLOP per cycle of the precision's widest unit; (0, why) when the clock or the flags are not known."""
    procs, flags = _fields(cpuinfo)
    mhz = [float(p["cpu MHz"]) for p in procs if p.get("cpu MHz", "").replace(".", "", 1).isdigit()]
    clock = max([*mhz, max_mhz or 0.0]) * 1e6
    unit = next(((fpc, name) for flag, fpc, name in FP32_FLOP_PER_CYCLE if flag in flags), None)
    if not clock or unit is None:
        return 0.0, "CPU peak unknown (no clock or vector flags in /proc/cpuinfo): MFU not computed"
    (fpc, name), kind = unit, "fp32"
    if precision in ("bf16", "fp16") and "amx_bf16" in flags:
        fpc, name, kind = AMX_BF16_FLOP_PER_CYCLE, "AMX", "bf16"
    elif precision in ("bf16", "fp16") and "avx512_bf16" in flags:
        fpc, name, kind = 2 * fpc, "AVX512_BF16", "bf16"
    cores = min(max(1, threads), physical_cores(cpuinfo))
    how = (f"CPU ISA peak: {cores} core{'s' if cores > 1 else ''} x {clock / 1e9:.2f} GHz x {fpc} {kind} "
           f"FLOP/cycle ({name})")
    if kind == "bf16":   # issue 34: what AMX / AVX512_BF16 reach is large matmuls' figure
        how += "; large matmuls only: a small model's step reaches a few % of it, docs/training.md"
    return cores * clock * fpc, how


def this_cpu_peak(threads: int, precision: str = "fp32") -> tuple[float, str]:
    """isa_peak of this machine's /proc/cpuinfo (and its cpufreq maximum, where there is one)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return 0.0, "CPU peak unknown (no /proc/cpuinfo): MFU not computed"
    try:
        max_mhz = int(CPUFREQ_MAX.read_text()) / 1000
    except (OSError, ValueError):
        max_mhz = None
    return isa_peak(text, threads, precision, max_mhz)
