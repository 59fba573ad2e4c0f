"""MFU's denominator: the device peak (datasheet on GPU, measured on CPU). The records go out through
tracking.MetricsProcessor."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
from functools import lru_cache
from pathlib import Path

import torch

from llmcluster.config.gpus import match_device_name


PEAK_CACHE_ENV = "LLMCLUSTER_CACHE"   # default ~/.cache/llmcluster
ROUNDS = 5


def _cpu_key(dtype: torch.dtype, threads: int) -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{socket.gethostname()}|{model}|{threads} threads|{str(dtype).removeprefix('torch.')}"


def _peak_cache() -> Path:
    return Path(os.environ.get(PEAK_CACHE_ENV) or Path.home() / ".cache" / "llmcluster") / "cpu_peak.json"


def _read_cache(path: Path) -> dict[str, float]:
    """Our own cache, read as data: anything that is not {key: positive number} is ignored."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and 0 < v < 1e18}


# A 1024³ product takes ~25 ms in fp32 on one AVX2 core but ~2.3 s in bf16/fp16 there (no native 16-bit
# arithmetic: emulated, ~1 GFLOP/s), and every rank of every run measures: ten of them cost each CPU bf16 run
# ~23 s before its first step. Below this rate (a 1024³ product over half a second; fp32 on a loaded core stays
# far above it) a 256³ product measures instead: so slow a path is compute-bound there already (1.3 GFLOP/s at 256,
# 0.9 at 1024 on the machine above).
SLOW_PATH_FLOPS = 2 * 1024**3 / 0.5


def _best_mm_seconds(n: int, dtype: torch.dtype, rounds: int) -> float:
    """The best time of one n³ matmul over `rounds` rounds of two, after a warm-up product."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(2):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 2)
        time.sleep(0.01)   # rounds apart in time: a burst of another job's load spoils one, not all
    return best


@lru_cache(maxsize=None)
def measured_cpu_peak_flops(dtype: torch.dtype = torch.float32, threads: int | None = None) -> float:
    """The CPU's achievable matmul peak at this thread count: the best 1024³ matmul of several rounds (256³ where
    the dtype's path is emulated and slow, SLOW_PATH_FLOPS), and the best ever seen on this machine at this thread
    count (cached). A peak measured once while other jobs load the machine is low, and MFU against it reads high:
    the same machine reported 29% at 3,984 tok/s and 11% at 10,569 tok/s. The best seen is the figure the machine
    can reach, so MFU compares across runs."""
    threads = threads or torch.get_num_threads()
    path, key = _peak_cache(), _cpu_key(dtype, threads)
    cache = _read_cache(path)
    n = 1024 if 2 * 256**3 / _best_mm_seconds(256, dtype, 1) >= SLOW_PATH_FLOPS else 256
    # With a best already cached, one round keeps it fresh: every rank of every run measures, and the other rounds
    # cost each ~0.25 s on one core for a figure the cache mostly holds already.
    measured = 2 * n**3 / _best_mm_seconds(n, dtype, 1 if key in cache else ROUNDS)
    peak = max(measured, cache.get(key, 0.0))
    if peak > cache.get(key, 0.0):
        try:   # atomic: the ranks of a job measure at once
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({**cache, key: peak}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass   # a read-only home: this process's measurement stands
    return peak


def peak_note(flops: float, source: str) -> str:
    """What MFU is divided by, figure and source: '0.0594 TFLOP/s, measured CPU fp32 matmul peak (...)'."""
    return f"{flops / 1e12:.3g} TFLOP/s, {source}" if flops else source


def device_peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from) for MFU: the datasheet peak on GPU, measured on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = match_device_name(name)
        if spec is not None:
            key = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
            return spec.peak_tflops(key) * 1e12, f"{spec.name} datasheet {key} peak"
        return 0.0, f"unknown GPU {name!r}: no datasheet peak"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    # A 16-bit peak is what AMX / AVX-512 BF16 reach on a large matmul; a small model's step mostly is not that
    # work, so its MFU reads a few percent (issue 34): said where the figure is printed.
    why = ("; large matmuls only: a small model's step reaches a few % of it, docs/training.md"
           if precision != "fp32" else "")
    return measured_cpu_peak_flops(dtype, torch.get_num_threads()), \
        f"measured CPU {precision} matmul peak ({torch.get_num_threads()} threads, best seen on this machine{why})"


def record_step(t, loss: float, norm: float, val: dict) -> None:
    """One metrics record of trainer `t` (every rank takes part: the step-time gathers are collectives)."""
    import statistics

    from llmcluster.distributed import process_groups as D
    from llmcluster.train.health import note_stragglers

    cfg, env = t.cfg, t.env
    # ft: the step's tokens are those of the groups that committed it (k of n), each group's on its own ranks
    k, n = (t.ft.participants, t.ft.groups) if t.ft else (1, 1)
    tps = t.global_batch * k / n * cfg.data.seq_len / t.dt
    mfu = t.flops_per_token * tps / (t.peak_flops * env.world_size * k) if t.peak_flops else 0.0
    times = D.gather_floats(statistics.median(t.step_times), env)
    busy_times = D.gather_floats(statistics.median(t.busy), env)
    t.step_times.clear()
    t.busy.clear()
    record = {"step": t.step, "loss": loss, "lr": t.lr_used,
              "grad_norm": norm, "tokens_per_s": tps, "mfu": mfu, "step_time_s": t.dt,
              "tokens_seen": (t.sampler.consumed - t.ft_skipped) * cfg.data.seq_len,
              "tokens_by_source": t.sampler.tokens_by_source(),
              "rank_step_time_s": times, "rank_busy_s": busy_times, "bad_steps": t.bad_total, **val}
    if t.ft:
        record["ft_groups"] = k   # the groups that committed this step
        record["ft_s"] = t.ft.take_timings()   # ft's parts of a step (quorum, copy, allreduce, commit): medians
    note_stragglers(busy_times, cfg.log.straggler_factor, t.metrics, t.log)
    t.metrics.write(record)
