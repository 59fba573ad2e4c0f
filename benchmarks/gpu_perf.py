"""gpu_check's performance mode (issue 36): where a training step's time goes at Llama-3-8B width, one process.

    python benchmarks/gpu_perf.py --work WORK [--cpu] [--slack K] [--deadline-s S] STEP=LIMIT_S ...

`bash benchmarks/gpu_check.sh --perf` runs this with its step budget (--perf --cpu-smoke: the same steps on CPU,
tiny shapes). Steps run in the order given, most wanted answer first, each under its own limit (x --slack),
and all inside --deadline-s. WORK/summary.json is rewritten as each step starts ("running") and ends, and a
step with several measurements writes each as it comes: a run killed part-way keeps everything it measured.
Run again on the same WORK, it resumes after the steps already there (a step left "running" crashed the
process: it is marked so and not retried). Exit 0: every step passed or was skipped with its reason.

    layers    step time and peak memory at L=2 with selective AC, then L=2/4/8 without: the per-layer slope
              -> per-layer MFU and the full-depth (32-layer) extrapolation (llmcluster/plan/calibration.py)
    gemm      the bf16 GEMM ceiling at the model's shapes, with the SM clock and power while it runs (NVML)
    phases    forward, backward, clip, optimizer (CUDA events; on CPU wall-clock stand-ins), and what FSDP's
              copies and casts cost: FSDP's forward+backward minus a plain bf16 model's
    sdpa      the kernel SDPA's dispatcher chooses for the model's attention, and fwd+bwd under each backend
    compile   eager vs torch.compile at L=2 and L=8, with the compile seconds (first step minus a steady one)
              (on CPU L=1/2/3 and L=1/3: the same code, shallower)
    loss      head + cross-entropy: eager, compiled, and chunked (train.loss_chunks) at the model's vocabulary
    accum     grad_accum 4 against 1 at L=2 (AdamW and the clip once per 4 micro-batches)
    float8    train.float8 (torchao) against bf16 at L=2, compiled on the GPU; emulated on CPU (the code path)

Everything runs through the trainer's own pieces (build_parallel_model, build_optimizer, clip_grad_norm,
step_context, bench's autocast rule) on one rank: FSDP at degree 1 as gpu_check's bench.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from gpu_perf_kernels import Clock, step_gemm, step_loss, step_sdpa   # benchmarks/, this script's folder
from llmcluster.plan.calibration import perf_figures

# Llama-3-8B's widths (the depth is what the steps vary) and the run's shape; on CPU the cheapest shapes that
# take every code path (GQA, FSDP over blocks and the root, a compiled block).
WIDTH = {"gpu": {"d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336, "vocab_size": 128256,
                 "rope_theta": 500000, "max_seq_len": 8192},
         "cpu": {"d_model": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64, "vocab_size": 257,
                 "max_seq_len": 64}}
# depths: the layer scaling's runs without AC; compile: the depths compiled against eager. On CPU shallower:
# there a block under FSDP's hooks costs a fixed ~0.1-0.3 s a step, and the figures are not the point.
SHAPE = {"gpu": {"seq_len": 4096, "micro_batch": 2, "steps": 5, "warmup": 2, "depths": (2, 4, 8),
                 "compile": (2, 8)},
         "cpu": {"seq_len": 16, "micro_batch": 2, "steps": 1, "warmup": 1, "depths": (1, 2, 3), "compile": (1, 3)}}
FULL_DEPTH = 32   # Llama-3-8B's: what the layer scaling extrapolates to


class StepTimeout(BaseException):
    """A step past its limit (BaseException: no `except Exception` inside a step swallows it)."""


class Summary:
    """WORK/summary.json, rewritten atomically whenever a step starts, measures something, or ends."""

    def __init__(self, work: Path, mode: str):
        self.path = work / "summary.json"
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        if self.data.get("mode") != "perf":
            self.data = {"mode": "perf", "device": mode, "steps": {}}
        for s in self.data["steps"].values():   # the previous process died inside this step
            if s["status"] == "running":
                s["status"], s["error"] = "crashed", "the process died during this step (see the log)"
        self.write()

    def step(self, name: str) -> dict:
        return self.data["steps"].setdefault(name, {"figures": {}})

    def write(self) -> None:
        steps = self.data["steps"]
        self.data["failed"] = [n for n, s in steps.items() if s["status"] not in ("pass", "skipped", "running")]
        self.data["ok"] = not self.data["failed"]
        tmp = self.path.with_name(".summary.json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


class Rig:
    """One process group of one rank, the device, and a training-step runner on the trainer's pieces."""

    def __init__(self, mode: str, summary: Summary):
        from llmcluster.distributed import process_groups as D

        self.mode, self.gpu, self.summary = mode, mode == "gpu", summary
        self.device = torch.device("cuda" if self.gpu else "cpu")
        self.env = D.init_distributed(self.config(2), need_group=True)
        from llmcluster.train.metrics import device_peak_flops

        self.peak, self.peak_source = device_peak_flops(self.device, "bf16")

    def config(self, layers: int, ac: str = "none", compile: bool = False, accum: int = 1, fsdp: bool = True,
               extra: tuple[str, ...] = ()):
        from llmcluster.config import load_job_config

        s = SHAPE[self.mode]
        sets = [f"model.{k}={v}" for k, v in WIDTH[self.mode].items()] + [
            f"model.n_layers={layers}", f"data.seq_len={s['seq_len']}", f"train.micro_batch={s['micro_batch']}",
            f"train.grad_accum={accum}", f"train.compile={str(compile).lower()}", "train.precision=bf16",
            f"train.device={self.device.type}", f"parallel.activation_checkpoint={ac}",
            f"parallel.dp_shard={-1 if fsdp else 1}", "parallel.dp_replicate=1", *extra]
        return load_job_config("llm_7b" if self.gpu else "llm_tiny", sets)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def free(self) -> None:
        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.gpu else None

    def train(self, cfg, phases: bool = False, plain_bf16: bool = False) -> dict:
        """Warm-up then timed optimizer steps of `cfg` (random tokens, one rank): the median step, the first
        step (compile included), peak memory, MFU; with `phases` the median of each phase too. plain_bf16:
        no FSDP and the parameters themselves in bf16 (no copies, no casts: what FSDP's are measured against)."""
        from llmcluster.distributed import process_groups as D
        from llmcluster.model import flops_per_token
        from llmcluster.train.bench import autocast
        from llmcluster.train.optimizer import build_optimizer
        from llmcluster.train.parallelize import build_parallel_model, clip_grad_norm, step_context

        self.free()
        dims = D.ParallelDims.from_config(cfg, 1)
        D.resolve_precision(cfg, self.env)
        torch.manual_seed(0)
        model, raw = build_parallel_model(cfg, dims, self.env, None)
        if plain_bf16:
            raw.to(torch.bfloat16)
        opt = build_optimizer(model, cfg.train, self.device)
        t, seq = cfg.train, cfg.data.seq_len
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.model.vocab_size, (t.micro_batch, seq + 1), generator=gen).to(self.device)
                   for _ in range(t.grad_accum)]
        ctx = step_context(dims, self.device)

        def step(clock: Clock) -> None:
            clock.mark()
            opt.zero_grad(set_to_none=True)
            for xy in batches:
                with ctx():
                    with autocast(cfg, dims, self.device):
                        loss = model(xy[:, :-1], xy[:, 1:], t.loss_chunks) / seq / t.micro_batch
                    clock.mark()
                    (loss / t.grad_accum).backward()
                clock.mark()
            clip_grad_norm(model.parameters(), t.grad_clip or float("inf"))
            clock.mark()
            opt.step()
            clock.mark()

        model.train()
        t0 = time.perf_counter()
        step(Clock(self.gpu))
        self.sync()
        first = time.perf_counter() - t0
        for _ in range(SHAPE[self.mode]["warmup"] - 1):
            step(Clock(self.gpu))
        runs = []
        for _ in range(SHAPE[self.mode]["steps"]):
            c = Clock(self.gpu)
            step(c)
            runs.append(c.intervals())
        total = statistics.median(sum(r) for r in runs)
        tokens = t.micro_batch * seq * t.grad_accum
        out = {"layers": cfg.model.n_layers, "ac": cfg.parallel.activation_checkpoint, "compile": t.compile,
               "grad_accum": t.grad_accum, "fsdp": dims.fsdp, "tokens_per_step": tokens, "step_s": total,
               "first_step_s": first, "tokens_per_s": tokens / total,
               "mfu": flops_per_token(cfg.model, seq) * tokens / total / self.peak if self.peak else None,
               "peak_memory_gib": self.peak_gib()}
        if phases:   # marks: start, (forward end, backward end) per micro-batch, clip end, optimizer end
            n = t.grad_accum
            med = lambda idx: statistics.median(sum(r[i] for i in idx) for r in runs)  # noqa: E731
            out["phases_s"] = {"forward": med(range(0, 2 * n, 2)), "backward": med(range(1, 2 * n, 2)),
                               "clip": med([2 * n]), "optimizer": med([2 * n + 1])}
        if t.compile:
            torch._dynamo.reset()
        return out   # the model and optimizer go with this frame; the next run's free() returns their memory


# ---------------------------------------------------------------------------------------------------------------
# The steps: each fills `fig` (written to the summary as it goes through `put`) and returns its status.


def step_layers(rig: Rig, fig: dict, put) -> str:
    fig["model"] = {**{k: v for k, v in WIDTH[rig.mode].items() if k != "max_seq_len"},
                    "seq_len": SHAPE[rig.mode]["seq_len"], "n_layers": FULL_DEPTH}
    fig.update(device_name=device_name(rig), peak_tflops=rig.peak / 1e12 if rig.peak else None,
               peak_source=rig.peak_source, tokens_per_step=SHAPE[rig.mode]["seq_len"] * SHAPE[rig.mode]["micro_batch"],
               depths=[])
    if not rig.gpu:
        fig["note"] = "CPU: tiny shapes (the code path); no per-run allocator peak, so no memory slope"
    for layers, ac in ((2, "selective"), *((d, "none") for d in SHAPE[rig.mode]["depths"])):
        fig["depths"].append(rig.train(rig.config(layers, ac)))
        fig["fit"] = perf_figures(fig)   # after each depth: a cut-short run keeps the slope it has
        put()
    return "pass"


def step_phases(rig: Rig, fig: dict, put) -> str:
    fig["clock"] = "CUDA events" if rig.gpu else "wall clock (CPU stand-in: no CUDA events, no FSDP casts)"
    fsdp = rig.train(rig.config(2), phases=True)
    fig["fsdp"] = fsdp
    put()
    plain = rig.train(rig.config(2, fsdp=False), phases=True, plain_bf16=True)
    fig["plain_bf16"] = plain
    f, p = fsdp["phases_s"], plain["phases_s"]
    fig["fsdp_copies_s"] = f["forward"] + f["backward"] - p["forward"] - p["backward"]
    fig["fsdp_copies_note"] = ("FSDP's forward+backward minus a plain model's with bf16 parameters (its all-gather "
                               "copy-in/out, the bf16 casts, the fp32 gradient reduce): an estimate, not a trace")
    return "pass"


def step_compile(rig: Rig, fig: dict, put) -> str:
    from llmcluster.train.parallelize import compile_available

    if why := compile_available(rig.device):
        fig["skipped"] = why
        return "skipped"
    fig["runs"] = []
    for layers in SHAPE[rig.mode]["compile"]:
        for compiled in (False, True):
            r = rig.train(rig.config(layers, compile=compiled))
            if compiled:
                r["compile_s"] = max(0.0, r["first_step_s"] - r["step_s"])
            fig["runs"].append(r)
            put()
        eager, comp = fig["runs"][-2:]
        fig[f"speedup_L{layers}"] = eager["step_s"] / comp["step_s"]
    return "pass"


def step_accum(rig: Rig, fig: dict, put) -> str:
    one = rig.train(rig.config(2), phases=True)
    fig["accum_1"] = one
    put()
    four = rig.train(rig.config(2, accum=4), phases=True)
    fig["accum_4"] = four
    fig["tokens_per_s_gain"] = four["tokens_per_s"] / one["tokens_per_s"]
    return "pass"


def step_float8(rig: Rig, fig: dict, put) -> str:
    from llmcluster.config.schema import Float8Config
    from llmcluster.errors import UserError
    from llmcluster.train.float8 import check_float8

    try:   # no torchao, an untested torch/torchao pair, below sm89: the trainer's own refusal, before any run
        check_float8(Float8Config(emulate=not rig.gpu), rig.device)
    except UserError as e:
        fig["skipped"] = str(e)
        return "skipped"
    # On the GPU compiled, as float8 is meant to run (torchao's casts fuse only under compile); on CPU the
    # emulated casts, eager: the config path, not a speed.
    compiled = rig.gpu
    recipes = ("tensorwise", "rowwise") if rig.gpu else ("tensorwise",)
    fig["bf16"] = rig.train(rig.config(2, compile=compiled))
    put()
    for recipe in recipes:
        extra = (f"train.float8.recipe={recipe}",) + (() if rig.gpu else ("train.float8.emulate=true",))
        r = rig.train(rig.config(2, compile=compiled, extra=extra))
        r["speedup_vs_bf16"] = fig["bf16"]["step_s"] / r["step_s"]
        fig[recipe] = r
        put()
    if not rig.gpu:
        fig["note"] = "CPU: emulated float8 (high-precision casts): the config path, no speed-up expected"
    return "pass"


STEPS = {"layers": step_layers, "gemm": step_gemm, "phases": step_phases, "sdpa": step_sdpa,
         "compile": step_compile, "loss": step_loss, "accum": step_accum, "float8": step_float8}


def device_name(rig: Rig) -> str:
    from llmcluster.train.bench import device_name as name

    return name(rig.device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--cpu", action="store_true", help="the code path on CPU, tiny shapes")
    p.add_argument("--slack", type=float, default=1.0, help="multiply each step's limit (a loaded CPU)")
    p.add_argument("--deadline-s", type=float, default=480.0, help="stop starting steps after this many seconds")
    p.add_argument("steps", nargs="+", metavar="STEP=LIMIT_S", help=f"in running order; steps: {', '.join(STEPS)}")
    a = p.parse_args(argv)
    plan = []
    for s in a.steps:
        name, _, limit = s.partition("=")
        if name not in STEPS or not limit.isdigit():
            p.error(f"not STEP=SECONDS with a known step: {s}")
        plan.append((name, int(limit)))
    mode = "cpu" if a.cpu else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        print("gpu_perf: no CUDA device (use --cpu for the code path)", file=sys.stderr)
        return 2
    a.work.mkdir(parents=True, exist_ok=True)
    summary = Summary(a.work, mode)
    start = time.monotonic()
    rig = None

    def on_alarm(*_):
        raise StepTimeout()
    signal.signal(signal.SIGALRM, on_alarm)
    for name, limit in plan:
        st = summary.step(name)
        if st.get("status") not in (None, "running"):
            continue   # done by an earlier process on this WORK
        st.update(status="running", limit_s=limit, figures={})
        summary.write()
        left = a.deadline_s - (time.monotonic() - start)
        t0 = time.monotonic()
        print(f"\n=== perf {name} (limit {limit * a.slack:.0f}s)  [{time.strftime('%H:%M:%S')}]", flush=True)
        if left < 1:
            st.update(status="skipped", error="the performance budget ran out before this step")
        else:
            signal.alarm(max(1, int(min(limit * a.slack, left))))
            try:
                rig = rig or Rig(mode, summary)
                st["status"] = STEPS[name](rig, st["figures"], summary.write)
            except StepTimeout:
                st.update(status="timeout", error=f"past its {limit * a.slack:.0f}s")
            except Exception as e:   # the figures say what failed; the next step still runs
                st.update(status="fail", error=f"{type(e).__name__}: {str(e)[:500]}")
            finally:
                signal.alarm(0)
                if rig is not None:   # what a failed or timed-out step left allocated
                    torch._dynamo.reset()
                    rig.free()
        st["seconds"] = round(time.monotonic() - t0, 1)
        summary.write()
        print(f"perf {name}: {st['status']} ({st['seconds']}s) {st.get('error', '')}", flush=True)
        print(json.dumps(st["figures"], default=str)[:2000], flush=True)
    return 0 if summary.data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
