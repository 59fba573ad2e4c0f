"""The probes of benchmarks/gpu_check.sh: one question each that only a GPU answers, asked in seconds.

    python benchmarks/gpu_probes.py PROBE --out FIGURES.json [--cpu]

    sdpa     with a document mask and GQA, the model's attention runs under the memory-efficient kernel alone
             (`sdpa_kernel(EFFICIENT_ATTENTION)` raises if SDPA refuses it, instead of falling to the math
             kernel's B·H·T² fp32 scores), receives K/V already expanded to n_heads, and matches the math
             reference.
    timing   one training step's host time (what the trainer's busy_s reads: kernels enqueued, not run)
             against its CUDA-event time read after the step's sync.
    nvml     the project's NVML exporter (monitor/nvml_metrics.GpuCollector) collecting once.
    thermal  the thermal gate (validate/thermal.check_thermal) under a short matmul load.

--cpu runs the same code on CPU with tiny shapes so the script cannot rot between GPU loans: SDPA's math
kernel stands in for the efficient one (CPU has no other that takes a mask), host time for CUDA events,
and tests/monitor_helpers.FakeNVML for NVML (a CPU machine has no libnvidia-ml). Exit 1 when the probe
fails; its figures go to --out as JSON either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def probe_sdpa(device: torch.device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from llmcluster.config.schema import ModelConfig
    from llmcluster.model import llama

    gpu = device.type == "cuda"
    # Llama-3-8B's attention (32 query heads over 8 kv heads, head_dim 128) at T=4096 on the GPU.
    B, T, d, H, KV = (1, 4096, 4096, 32, 8) if gpu else (2, 64, 64, 4, 2)
    cfg = ModelConfig(d_model=d, n_heads=H, n_kv_heads=KV, max_seq_len=T)
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    attn = llama.Attention(cfg).to(device=device, dtype=dtype)
    cos, sin = (t.to(device=device, dtype=dtype) for t in llama.rope_cos_sin(cfg.head_dim, T, cfg.rope_theta))
    tokens = torch.randint(1, 100, (B, T), device=device)
    tokens[:, T // 3] = tokens[:, 2 * T // 3] = 0            # three packed documents per row
    mask = llama.document_mask(tokens, 0)
    x = torch.randn(B, T, d, device=device, dtype=dtype, requires_grad=True)

    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *a, **kw):   # what attention hands SDPA: K/V expanded, no enable_gqa
        seen.append((q.shape[1], k.shape[1], bool(kw.get("enable_gqa", False))))
        return sdpa(q, k, v, *a, **kw)

    backend = SDPBackend.EFFICIENT_ATTENTION if gpu else SDPBackend.MATH
    F.scaled_dot_product_attention = recording
    try:
        with sdpa_kernel(backend):    # raises "No available kernel" if the kernel refuses these inputs
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            y = attn(x, cos, sin, mask=mask)
            y.float().square().mean().backward()
            if gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
    finally:
        F.scaled_dot_product_attention = sdpa
    q_heads, k_heads, gqa = seen[0]
    # The reference: the math kernel on the unexpanded K/V with SDPA's own GQA broadcast, in fp32.
    with torch.no_grad():
        xf = x.detach().float()
        a32 = llama.Attention(cfg).to(device)
        a32.load_state_dict({k: v.float() for k, v in attn.state_dict().items()})
        B_, T_, _ = xf.shape
        q = a32.q_proj(xf).view(B_, T_, -1, cfg.head_dim).transpose(1, 2)
        k = a32.k_proj(xf).view(B_, T_, -1, cfg.head_dim).transpose(1, 2)
        v = a32.v_proj(xf).view(B_, T_, -1, cfg.head_dim).transpose(1, 2)
        c32, s32 = cos.float(), sin.float()
        q, k = llama.apply_rope(q, c32, s32), llama.apply_rope(k, c32, s32)
        with sdpa_kernel(SDPBackend.MATH):
            ref = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        ref = a32.o_proj(ref.transpose(1, 2).reshape(B_, T_, -1))
        err = ((y.detach().float() - ref).abs().max() / ref.abs().max()).item()
    tol = 2e-2 if gpu else 1e-5
    ok = k_heads == q_heads and not gqa and err < tol
    return {"ok": ok, "kernel": backend.name, "shape": [B, T, H, KV], "kv_heads_seen": k_heads,
            "q_heads": q_heads, "rel_err_vs_math": err, "tol": tol, "fwd_bwd_s": round(seconds, 4),
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None}


def probe_timing(device: torch.device) -> dict:
    from llmcluster.config.schema import ModelConfig
    from llmcluster.model.llama import build_model

    gpu = device.type == "cuda"
    cfg = (ModelConfig(n_layers=8, d_model=2048, n_heads=16, n_kv_heads=4, ffn_hidden=5632, vocab_size=32000,
                       max_seq_len=2048) if gpu else
           ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256,
                       max_seq_len=64))
    B, T = (4, 2048) if gpu else (2, 64)
    # Each phase's time on stderr: the first H200 run timed out here with nothing to say where it spent its 15 s.
    t_start = time.perf_counter()
    phase = lambda what: print(f"timing: {what} at {time.perf_counter() - t_start:.1f} s", file=sys.stderr,  # noqa: E731
                               flush=True)
    torch.manual_seed(0)
    model = build_model(cfg, device)  # drawn in place on the device: the seeded CPU draw is not what is timed
    phase("model built")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=gpu)
    tok = torch.randint(0, cfg.vocab_size, (B, T + 1), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = model(tok[:, :-1], targets=tok[:, 1:]) / (B * T)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: allocator, cuBLAS handles, fused AdamW state
        step()
    phase("warm-up done")
    host, dev = [], []
    for _ in range(5):
        if gpu:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)   # the trainer's busy_s: the host returns once kernels are queued
        if gpu:
            end.record()
            end.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
    h = sorted(host)[len(host) // 2]
    d = sorted(dev)[len(dev) // 2] if dev else None
    return {"ok": d is None or d > 0, "host_step_s": round(h, 5), "cuda_event_step_s": d and round(d, 5),
            "host_over_device": d and round(h / d, 3), "params": sum(p.numel() for p in model.parameters()),
            "note": "host time under-reads the step when host/device is well below 1" if gpu else
                    "cpu: no CUDA events, host time only (the code path)"}


def _nvml(gpu: bool):
    """Real pynvml on the GPU machine; on CPU the tests' fake (no libnvidia-ml here), said in the figures."""
    if gpu:
        import pynvml
        return pynvml, "pynvml"
    sys.path.insert(0, str(REPO / "tests"))
    from monitor_helpers import FakeNVML, fake_gpu
    return FakeNVML([fake_gpu(0, throttle=0x4)]), "tests/monitor_helpers.FakeNVML (no NVML on a CPU machine)"


def probe_nvml(device: torch.device) -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    from llmcluster.monitor.nvml_metrics import GpuCollector

    nv, source = _nvml(device.type == "cuda")
    c = GpuCollector(nvml=nv)
    try:
        reg = CollectorRegistry()
        reg.register(c)
        text = generate_latest(reg).decode()
    finally:
        c.close()
    names = sorted({ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")})
    return {"ok": c.error is None and c.count >= 1 and len(names) > 3, "nvml": source, "gpus": c.count,
            "error": c.error, "metrics": len(names), "names": names}


def probe_thermal(device: torch.device, seconds: float) -> dict:
    from llmcluster.validate import thermal
    from llmcluster.validate.spec import load_spec

    spec = load_spec(None)
    nv, source = _nvml(device.type == "cuda")
    if device.type == "cuda":
        nv.nvmlInit()
        r = thermal.check_thermal(device, spec, seconds, nvml=nv)
    else:   # no load to run: judge readings from the fake, through the same sample/judge code
        samples = [thermal.sample(nv, 0) for _ in range(4)]
        r = thermal.judge(samples, spec, power_limit_w=700.0)
    d = r.to_dict()
    return {"ok": d["status"] in ("PASS", "WARN"), "nvml": source, "status": d["status"], "reason": d["reason"],
            "items": [(i["name"], i["status"], i["value"]) for i in d["items"]],
            "matmuls": d["data"].get("matmuls")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("probe", choices=("sdpa", "timing", "nvml", "thermal"))
    p.add_argument("--out", required=True, help="write the probe's figures here (JSON)")
    p.add_argument("--cpu", action="store_true", help="the code path on CPU, tiny shapes, fake NVML")
    p.add_argument("--seconds", type=float, default=10.0, help="thermal: load time")
    a = p.parse_args()
    device = torch.device("cpu" if a.cpu else "cuda")
    if not a.cpu and not torch.cuda.is_available():
        print("gpu_probes: no CUDA device (use --cpu for the code path)", file=sys.stderr)
        return 2
    fn = {"sdpa": probe_sdpa, "timing": probe_timing, "nvml": probe_nvml}.get(a.probe)
    try:
        r = fn(device) if fn else probe_thermal(device, a.seconds)
    except Exception as e:   # a refused kernel, a missing NVML call: the figures say which, the step FAILs
        r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    Path(a.out).write_text(json.dumps(r, indent=1, default=str))
    print(f"{a.probe}: {'ok' if r['ok'] else 'FAILED'} " + json.dumps({k: v for k, v in r.items() if k != "names"},
                                                                       default=str))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
