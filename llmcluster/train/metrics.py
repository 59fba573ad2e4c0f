"""What a run reports: metrics.jsonl, TensorBoard, the progress line/bar, MFU and the device peak."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
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


@lru_cache(maxsize=None)
def measured_cpu_peak_flops(dtype: torch.dtype = torch.float32, threads: int | None = None) -> float:
    """The CPU's achievable matmul peak at this thread count: the best 1024³ matmul of several rounds, and the
    best ever seen on this machine at this thread count (cached). A peak measured once while other jobs load the
    machine is low, and MFU against it reads high: the same machine reported 29% at 3,984 tok/s and 11% at
    10,569 tok/s. The best seen is the figure the machine can reach, so MFU compares across runs."""
    threads = threads or torch.get_num_threads()
    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(2):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 2)
        time.sleep(0.01)   # rounds apart in time: a burst of another job's load spoils one, not all
    measured = 2 * n**3 / best
    path, key = _peak_cache(), _cpu_key(dtype, threads)
    cache = _read_cache(path)
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
    return measured_cpu_peak_flops(dtype, torch.get_num_threads()), \
        f"measured CPU {precision} matmul peak ({torch.get_num_threads()} threads, best seen on this machine)"


class MetricsLog:
    """Rank 0's record of the run: one JSON object per logged step, plus TensorBoard and a live view."""

    def __init__(self, log_dir: Path, total_steps: int, start_step: int, tensorboard: bool, progress: bool):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self.file = open(self.path, "a", buffering=1)
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.time()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(log_dir / "tensorboard"))
            except ImportError:
                print("warning: log.tensorboard=true but tensorboard is not installed", file=sys.stderr)
        self.bar = None
        if progress and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, info="")
            self.bar.start()

    def eta_s(self, step: int) -> float:
        done = step - self.start_step
        return (time.time() - self.t0) / done * (self.total - step) if done > 0 else float("nan")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])
        info = " ".join(self._fmt(record))
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], info=info)
        else:
            eta = self.eta_s(record["step"])
            eta_txt = f" eta {eta / 60:.1f}m" if eta == eta else ""
            print(f"step {record['step']}/{self.total} {info}{eta_txt}", flush=True)

    @staticmethod
    def _fmt(r: dict) -> list[str]:
        out = [f"loss {r['loss']:.4f}"]
        if "val_loss" in r:
            out.append(f"val {r['val_loss']:.4f}")
        out += [f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:,.0f} tok/s", f"mfu {100 * r['mfu']:.1f}%"]
        return out

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.tb is not None:
            self.tb.close()
        self.file.close()
