"""compute, memory and pcie: what one device achieves, against its datasheet.

compute — matmul throughput over a sweep of shapes, as ml-engineering's MAMF finder measures it: the best
           shape's median TFLOP/s (2*m*n*k per matmul), bf16 gated against the published MAMF figure.
memory  — a large device-to-device copy; bandwidth counts the bytes read plus the bytes written.
pcie    — host->device and device->host copies of a 1 GiB buffer, pinned and pageable.

GPU timing rules (each one is a classic way to get a wrong number): inputs allocated and the output
preallocated before timing, warm-up calls first (cuBLAS heuristics, clocks ramp up), a synchronize
before the clock starts, CUDA events recorded on the stream around a batch of calls, and the median of
several batches. On CPU the same code reports measured GFLOP/s and host memory GB/s (no datasheet).
"""

from __future__ import annotations

import statistics
import time

import torch

from llmcluster.validate.result import PASS, SKIP, CheckResult, fmt_bytes, fmt_rate, grade
from llmcluster.validate.spec import ValidateSpec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}


def gpu_shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(m, n, k): a MAMF-finder-style grid; quick is one large square shape."""
    if quick:
        return [(8192, 8192, 8192)]
    dims, ks = (4096, 8192, 16384), (2048, 4096, 8192)
    return [(m, n, k) for m in dims for n in dims for k in ks]


def cpu_shapes(quick: bool) -> list[tuple[int, int, int]]:
    return [(1024, 1024, 1024)] if quick else [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 2048)]


class Stopwatch:
    """Times `fn` called `iters` times: CUDA events on a GPU, the wall clock on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn, iters: int) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - t0


def timed_rate(fn, work: float, device, warmup_s: float = 0.1, batches: int = 5, batch_s: float = 0.05) -> float:
    """Median over `batches` of work per second, each batch sized to take about batch_s seconds.

    Warm-up is by time, not by count (at least 2 calls): long enough for cuBLAS to pick its kernel and
    the clocks to ramp, without a 60 ms fp32 matmul paying 20 warm-up calls.
    """
    watch = Stopwatch(device)
    spent, calls = 0.0, 0
    while calls < 2 or spent < warmup_s:
        spent += watch(fn, 1)
        calls += 1
    one = max(watch(fn, 1), 1e-6)
    iters = max(1, min(1000, int(batch_s / one)))
    return statistics.median(work * iters / watch(fn, iters) for _ in range(batches))


def matmul_tflops(device, dtype: str, m: int, n: int, k: int, quick: bool) -> float:
    a = torch.randn(m, k, device=device, dtype=DTYPES[dtype])
    b = torch.randn(k, n, device=device, dtype=DTYPES[dtype])
    c = torch.empty(m, n, device=device, dtype=DTYPES[dtype])
    fn = lambda: torch.mm(a, b, out=c)  # noqa: E731
    flops = 2.0 * m * n * k
    if device.type == "cuda":
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        try:
            return timed_rate(fn, flops, device, warmup_s=0.1 if quick else 0.3, batch_s=0.05 if quick else 0.1) / 1e12
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return timed_rate(fn, flops, device, warmup_s=0.05, batches=3, batch_s=0.1 if quick else 0.3) / 1e12


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return platform.processor() or platform.machine()


def check_compute(device, spec: ValidateSpec, quick: bool) -> CheckResult:
    r = CheckResult("compute")
    name = device_name(device)
    r.data.update(device=name, shapes=[])
    if device.type != "cuda":
        # fp32 only: without AMX, CPU bf16 matmuls run at a few % of fp32 (measured on a Zen 5 core:
        # 0.5-0.8 GFLOP/s bf16 vs 20-35 fp32), which says nothing about the machine
        for dtype in ("fp32",):
            best = max((matmul_tflops(device, dtype, *s, quick), s) for s in cpu_shapes(quick))
            r.data["shapes"].append({"dtype": dtype, "shape": best[1], "tflops": best[0]})
            r.add(f"{dtype} matmul {'x'.join(map(str, best[1]))}", PASS, fmt_rate(best[0] * 1e3, "GFLOP/s"),
                  f"CPU, {torch.get_num_threads()} thread(s): measured, no datasheet peak to compare")
        return r
    gpu = spec.gpu_model(name)
    for dtype in (("bf16",) if quick else ("bf16", "fp16", "tf32", "fp32")):
        results = []
        for shape in gpu_shapes(quick):
            tf = matmul_tflops(device, dtype, *shape, quick)
            results.append((tf, shape))
            r.data["shapes"].append({"dtype": dtype, "shape": shape, "tflops": tf})
        best, shape = max(results)
        label = f"{dtype} matmul {'x'.join(map(str, shape))}"
        if gpu is None:
            r.add(label, PASS, fmt_rate(best, "TFLOP/s"), f"'{name}' is not in the GPU table: report only")
            continue
        peak = gpu.peak_tflops(dtype)
        if dtype in ("bf16", "fp16"):
            # gate against what the best kernels reach (MAMF), not the datasheet no kernel reaches
            expect = gpu.mamf_bf16_tflops or 0.8 * peak
            status = grade(best / expect, spec.compute_pass_at, spec.compute_warn_at)
            r.add(label, status, fmt_rate(best, "TFLOP/s"),
                  f"{best / peak:.0%} of {gpu.name} peak {peak:g}; {best / expect:.0%} of achievable "
                  f"{expect:g} (PASS >= {spec.compute_pass_at:.0%})")
        else:
            r.add(label, PASS, fmt_rate(best, "TFLOP/s"), f"{best / peak:.0%} of {gpu.name} peak {peak:g} (report only)")
    return r


def copy_gbps(device, nbytes: int, quick: bool) -> float:
    """Device-local copy bandwidth in GB/s, counting bytes read + bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return timed_rate(lambda: dst.copy_(src), 2.0 * nbytes, device, warmup_s=0.05 if quick else 0.2,
                      batch_s=0.05 if quick else 0.2) / 1e9


def check_memory(device, spec: ValidateSpec, quick: bool) -> CheckResult:
    r = CheckResult("memory")
    name = device_name(device)
    if device.type != "cuda":
        nbytes = (64 if quick else 256) << 20
        bw = copy_gbps(device, nbytes, quick)
        r.data.update(device=name, bytes=nbytes, copy_GBps=bw)
        r.add(f"host copy {fmt_bytes(nbytes)}", PASS, fmt_rate(bw, "GB/s"),
              "host memory (read + write), measured; no datasheet to compare")
        return r
    free, _total = torch.cuda.mem_get_info(device)
    # far larger than the L2 cache (50-60 MB), and two buffers must fit with room to spare
    nbytes = min((1 if quick else 4) << 30, free // 4)
    bw = copy_gbps(device, nbytes, quick)
    r.data.update(device=name, bytes=nbytes, copy_GBps=bw)
    gpu = spec.gpu_model(name)
    label = f"device copy {fmt_bytes(nbytes)}"
    if gpu is None:
        r.add(label, PASS, fmt_rate(bw, "GB/s"), f"'{name}' is not in the GPU table: report only")
    else:
        ratio = bw / gpu.memory_bw_gbps
        r.add(label, grade(ratio, spec.memory_pass_at, spec.memory_warn_at), fmt_rate(bw, "GB/s"),
              f"{ratio:.0%} of {gpu.name} {gpu.memory_bw_gbps:g} GB/s (PASS >= {spec.memory_pass_at:.0%})")
    return r


def check_pcie(device, spec: ValidateSpec, quick: bool) -> CheckResult:
    r = CheckResult("pcie")
    if device.type != "cuda":
        r.add("host<->device", SKIP, detail="no CUDA device")
        return r
    name = device_name(device)
    gpu = spec.gpu_model(name)
    expect = spec.pcie_expect_GBps(gpu)
    nbytes = (256 if quick else 1024) << 20
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for memory in ("pinned", "pageable"):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=memory == "pinned")
        for direction, fn in (("H2D", lambda: dev.copy_(host, non_blocking=True)),
                              ("D2H", lambda: host.copy_(dev, non_blocking=True))):
            bw = timed_rate(fn, nbytes, device, warmup_s=0.05, batches=3 if quick else 5) / 1e9
            r.data[f"{direction}_{memory}_GBps"] = bw
            label = f"{direction} {memory} {fmt_bytes(nbytes)}"
            if memory == "pinned" and expect:
                ratio = bw / expect
                r.add(label, grade(ratio, spec.pcie_pass_at, spec.pcie_warn_at), fmt_rate(bw, "GB/s"),
                      f"{ratio:.0%} of {expect:g} GB/s achievable (PASS >= {spec.pcie_pass_at:.0%})")
            else:
                r.add(label, PASS, fmt_rate(bw, "GB/s"), "report only (pageable copies stage through a "
                      "bounce buffer)" if memory == "pageable" else "no expected figure: report only")
        del host
    return r


def matmul_load(device, stop, n: int = 8192) -> int:
    """Back-to-back bf16 matmuls until stop.is_set() (the thermal check's load); returns the count."""
    dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    count = 0
    while not stop.is_set():
        for _ in range(20):
            torch.mm(a, b, out=c)
        if device.type == "cuda":
            torch.cuda.synchronize(device)   # keep the queue short so stop is seen within ~0.1 s
        count += 20
    return count
