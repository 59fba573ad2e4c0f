"""The kernel-level steps of gpu_check's performance mode (benchmarks/gpu_perf.py runs them): SDPA per backend,
head + cross-entropy variants, the bf16 GEMM ceiling with NVML, and the device-timeline clock they share.
Each step takes gpu_perf's Rig (the device, `config(layers)`, `free()`, `peak_gib()`), fills its figures and
returns its status."""

from __future__ import annotations

import statistics
import time

import torch


class Clock:
    """Marks on the device's timeline (CUDA events) or, on CPU, the host's (there the work is synchronous)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (waits for the last one)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def timed(rig, fn, repeat: int = 5, warmup: int = 2) -> float:
    """Median seconds of fn() on the device's timeline."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        c = Clock(rig.gpu)
        c.mark()
        fn()
        c.mark()
        out.append(c.intervals()[0])
    return statistics.median(out)


def step_sdpa(rig, fig: dict, put) -> str:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from llmcluster.train.attention import chosen_kernel, device_order

    cfg = rig.config(2)
    m, T, B = cfg.model, cfg.data.seq_len, cfg.train.micro_batch
    order = device_order(rig.device)
    fig["chosen"] = chosen_kernel(m, T, rig.device, torch.bfloat16, order)
    fig["order"] = order or "CPU dispatcher (fused flash, then math)"
    fig["shape"] = {"batch": B, "seq": T, "heads": m.n_heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim}

    def qkv(kv: int):
        mk = lambda h: torch.randn(B, h, T, m.head_dim, device=rig.device, dtype=torch.bfloat16,  # noqa: E731
                                   requires_grad=True)
        return mk(m.n_heads), mk(kv), mk(kv)

    fig["backends"] = {}
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
        got = {}
        # The model's call (causal, GQA broadcast by SDPA); where a kernel refuses the broadcast, K/V expanded
        # to every query head (what the model does under a document mask).
        for how, kv, gqa in (("gqa", m.kv_heads, True), ("kv expanded", m.n_heads, False)):
            q, k, v = qkv(kv)

            def run():
                with sdpa_kernel(getattr(SDPBackend, name)):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).sum().backward()
            try:
                got = {"fwd_bwd_s": timed(rig, run, repeat=3, warmup=1), "inputs": how}
                break
            except RuntimeError as e:   # "No available kernel": this backend refuses these inputs
                got = {"refused": str(e).splitlines()[0][:200]}
        fig["backends"][name] = got
        put()
    ok = any("fwd_bwd_s" in b for b in fig["backends"].values())
    return "pass" if ok else "fail"


def step_loss(rig, fig: dict, put) -> str:
    from llmcluster.model.loss import head_loss
    from llmcluster.train.parallelize import compile_available

    cfg = rig.config(2)
    m, T, B = cfg.model, cfg.data.seq_len, cfg.train.micro_batch
    chunks = max(cfg.train.loss_chunks, 4)
    torch.manual_seed(0)
    head = torch.nn.Linear(m.d_model, m.vocab_size, bias=False, device=rig.device, dtype=torch.bfloat16)
    h = torch.randn(B, T, m.d_model, device=rig.device, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, m.vocab_size, (B, T), device=rig.device)
    # the model's own loss paths (model/loss.py): whole, sliced (gradients per slice, no recompute), compiled
    variants = {"eager": lambda h_, y_: head_loss(head, h_, y_),
                f"chunked_{chunks}": lambda h_, y_: head_loss(head, h_, y_, chunks)}
    if why := compile_available(rig.device):
        fig["compiled"] = f"skipped: {why}"
    else:
        variants["compiled"] = lambda h_, y_: head_loss(head, h_, y_, compiled=True)
        variants[f"compiled_chunked_{chunks}"] = lambda h_, y_: head_loss(head, h_, y_, chunks, compiled=True)
    fig["shape"] = {"tokens": B * T, "d_model": m.d_model, "vocab": m.vocab_size, "loss_chunks": chunks}
    fig["variants"], ref = {}, None
    for name, fn in variants.items():
        rig.free()
        value = []

        def run():
            h.grad = head.weight.grad = None
            loss = fn(h, y)
            loss.backward()
            value.append(loss.detach())
        t0 = time.perf_counter()
        run()   # the first call compiles (the compiled variant): timed apart
        rig.sync()
        first = time.perf_counter() - t0
        s = timed(rig, run, repeat=3, warmup=1)
        v = float(value[-1])
        ref = v if ref is None else ref
        fig["variants"][name] = {"fwd_bwd_s": s, "first_call_s": first, "loss": v, "rel_diff": abs(v - ref) / ref,
                                 "peak_memory_gib": rig.peak_gib()}
        put()
    torch._dynamo.reset()
    return "pass" if all(x["rel_diff"] < 1e-2 for x in fig["variants"].values()) else "fail"


def step_gemm(rig, fig: dict, put) -> str:
    cfg = rig.config(2)
    m = cfg.model
    M = cfg.train.micro_batch * cfg.data.seq_len
    kv = m.kv_heads * m.head_dim
    shapes = {"qkv": (m.d_model, m.d_model + 2 * kv), "o": (m.d_model, m.d_model), "gate": (m.d_model, m.ffn_hidden),
              "up": (m.d_model, m.ffn_hidden), "down": (m.ffn_hidden, m.d_model), "head": (m.d_model, m.vocab_size)}
    fig["tokens"], fig["gemms"] = M, {}
    work = []
    for name, (K, N) in shapes.items():
        a = torch.randn(M, K, device=rig.device, dtype=torch.bfloat16)
        w = torch.randn(K, N, device=rig.device, dtype=torch.bfloat16)
        s = timed(rig, lambda: a @ w, repeat=10 if rig.gpu else 3, warmup=3 if rig.gpu else 1)
        fig["gemms"][name] = {"K": K, "N": N, "tflops": 2 * M * K * N / s / 1e12}
        work.append((name, 2 * M * K * N, s, a, w))
    block = [x for x in work if x[0] != "head"]
    # The block's GEMMs run back to back: their FLOPs over their summed time, the rate the step model's
    # residual is measured against (plan --calibrate).
    fig["ceiling_tflops"] = sum(f for _, f, *_ in block) / sum(s for _, _, s, *_ in block) / 1e12
    if not rig.gpu:
        fig["nvml"] = {"skipped": "no GPU: the SM clock and power under this load are NVML's (none on a CPU)"}
        fig["note"] = "CPU: tiny shapes, host time: the code path, not a ceiling"
        return "pass"
    fig["nvml"] = nvml_under_load(rig, block)
    return "pass"


def nvml_under_load(rig, block: list) -> dict:
    """SM clock and power sampled while about two seconds of the block's GEMMs are queued on the GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    except Exception as e:   # no pynvml, no libnvidia-ml: the ceiling stands without them
        return {"skipped": f"NVML unavailable: {type(e).__name__}: {e}"}
    per_round = sum(s for _, _, s, *_ in block)
    for _ in range(max(1, int(2.0 / per_round))):
        for *_, a, w in block:
            a @ w
    samples = []
    for _ in range(10):
        time.sleep(0.1)
        samples.append((pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1e3))
    torch.cuda.synchronize()
    clocks, watts = zip(*samples)
    return {"sm_clock_mhz": statistics.median(clocks), "sm_clock_max_mhz":
            pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM), "power_w": statistics.median(watts),
            "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1e3, "samples": len(samples)}
