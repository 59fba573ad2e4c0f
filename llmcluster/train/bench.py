"""`llmcluster bench`: the training step's throughput on this machine, with the job's model and mesh.

Same pieces as `train` (ParallelDims → parallelize → AdamW → autocast rule), random tokens instead of a
dataset (the input pipeline is never the bottleneck, and a benchmark should not need one), warm-up steps
that are not timed (compile, allocator, first all-gathers), then timed steps. The step time is the
median over the timed steps of the slowest rank.

MFU follows PaLM (6N + 12·L·H·Q·T FLOPs per token, recompute not counted) divided by the peak for the
precision actually used: the datasheet figure on a known GPU, the instruction set's peak on CPU (config/cpus.py). With pipeline
parallelism the measured MFU includes the bubble (idle stages are lost time); the record also carries the
schedule's bubble fraction (p-1)/(v·m+p-1) so that `plan --calibrate`, whose step-time model adds the
bubble itself, divides it back out. The record under <root>/logs/bench/ is what `plan --calibrate` reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import time
import warnings
from pathlib import Path

import torch

from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError
from llmcluster.model import flops_per_token
from llmcluster.model.flops import param_count
from llmcluster.model.llama import cross_entropy_sum
from llmcluster.config.cluster_load import storage_root
from llmcluster.storage.layout import Storage
from llmcluster.distributed import process_groups as D
from llmcluster.train.metrics import device_peak_flops, peak_note
from llmcluster.train.optimizer import build_optimizer
from llmcluster.train.parallelize import build_parallel_model, clip_grad_norm, step_context
from llmcluster.train.resources import resolve_activation_checkpoint
from llmcluster.train.pipeline import bubble_fraction, build_pipeline


def autocast(cfg: JobConfig, dims: D.ParallelDims, device: torch.device):
    """The trainer's rule: FSDP's MixedPrecisionPolicy casts on GPU; autocast everywhere else."""
    p = cfg.train.precision
    if p == "fp32" or (dims.fsdp and device.type == "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if p == "bf16" else torch.float16)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_bench(cfg: JobConfig, root: Path, steps: int, warmup: int) -> dict:
    if steps < 1 or warmup < 0:
        raise UserError(f"--steps must be >= 1 and --warmup >= 0 (got {steps} and {warmup})")
    world = int(os.environ.get("WORLD_SIZE", 1))
    dims = D.ParallelDims.from_config(cfg, world)
    env = D.init_distributed(cfg, need_group=dims.needs_group)
    D.resolve_precision(cfg, env)
    if (ac_line := resolve_activation_checkpoint(cfg, dims, env.device)) and env.is_main:
        print(ac_line, flush=True)
    t = cfg.train
    dp = dims.dp
    global_batch = t.micro_batch * t.grad_accum * dp
    seq = cfg.data.seq_len
    if seq > cfg.model.max_seq_len:
        raise UserError(f"data.seq_len ({seq}) exceeds model.max_seq_len ({cfg.model.max_seq_len})")
    out_dir = Storage(root).require_writable(root / "logs" / "bench")

    def ce(logits, y):  # the pipeline's loss function: a micro-batch's share of the step's mean (pipeline.py)
        return cross_entropy_sum(logits, y) / y.numel() / t.grad_accum

    # Throughput does not need the host-independent seeded draw (model/init.py, tens of seconds of CPU at 8B
    # width): weights drawn in place on the device from the global generator, seeded here.
    torch.manual_seed(cfg.run.seed)
    with warnings.catch_warnings():
        # TP on CPU: DTensor warns that its random operators "may not have complete support on cpu device mesh"
        # (a raw UserWarning with a site-packages path). These are throughput-only weights, never trained or
        # compared (the trainer's seeded init draws on the host), so how DTensor draws them changes nothing here.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support",
                                category=UserWarning)
        pipe = build_pipeline(cfg, dims, env, None, ce) if dims.pp > 1 else None
        model = pipe.model if pipe else build_parallel_model(cfg, dims, env, None)[0]
    if env.is_main:
        from llmcluster.train.attention import attention_line

        print(attention_line(cfg, env.device), flush=True)
    optimizer = build_optimizer(model, t, env.device)
    # Random tokens, different per data-parallel rank, identical across a TP group (TP ranks share input).
    gen = torch.Generator().manual_seed(cfg.run.seed + dims.dp_rank(env.rank))

    def batch():
        xy = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, seq + 1), generator=gen)
        return xy[:, :-1].to(env.device), xy[:, 1:].to(env.device)

    ddp = dims.ddp and env.distributed
    step_ctx = step_context(dims, env.device)   # TP's loss_parallel, SDPA's backend order

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        for i in range(t.grad_accum if pipe is None else 0):
            x, y = batch()
            sync = model.no_sync() if ddp and i < t.grad_accum - 1 else contextlib.nullcontext()
            with sync, step_ctx():
                with autocast(cfg, dims, env.device):
                    loss = model(x, y, t.loss_chunks) / y.numel()  # as the trainer: train.loss_chunks counts
                (loss / t.grad_accum).backward()
        if pipe is not None:  # the rank's grad_accum micro-batches as one batch through the schedule
            xs, ys = zip(*(batch() for _ in range(t.grad_accum)))
            with autocast(cfg, dims, env.device):
                losses = pipe.step(torch.cat(xs), torch.cat(ys))
            loss = losses[-1] if losses else torch.zeros(())
        norm = clip_grad_norm(model.parameters(), t.grad_clip or float("inf"), pipe.pp_group if pipe else None)
        optimizer.step()
        # a host sync: the step's work has finished when this returns (the norm is reduced over pp ranks)
        return float(norm) if pipe is not None else float(loss.detach())

    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    model.train()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        times.append(time.perf_counter() - t0)
    step_time = D.all_reduce_max(statistics.median(times), env)  # the slowest rank sets the pace
    peak_mem = int(D.all_reduce_max(float(peak_memory_bytes(env.device)), env))
    peak, source = device_peak_flops(env.device, t.precision)
    fpt = flops_per_token(cfg.model, seq)
    tps = global_batch * seq / step_time
    bubble = bubble_fraction(dims.pp, dims.virtual_stages, t.grad_accum)
    record = {
        "model_params": param_count(cfg.model), "flops_per_token": fpt,
        "tokens_per_s": tps, "tokens_per_s_per_device": tps / world, "step_time_s": step_time,
        "mfu": fpt * tps / (peak * world) if peak else None, "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": source, "device_name": device_name(env.device), "precision": t.precision,
        "world_size": world, "seq_len": seq, "micro_batch": t.micro_batch, "grad_accum": t.grad_accum,
        "global_batch": global_batch,
        "parallel": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
                     "pp": dims.pp, "pp_schedule": dims.pp_schedule, "pp_virtual_stages": dims.virtual_stages,
                     "fsdp": dims.fsdp, "activation_checkpoint": cfg.parallel.activation_checkpoint,
                     "ac_every": cfg.parallel.ac_every,
                     "compile": t.compile, "describe": dims.describe()},
        "pipeline_bubble": bubble,
        "peak_memory_bytes": peak_mem, "steps": steps, "warmup": warmup, "run": cfg.run.name,
        "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if env.is_main:
        path = out_dir / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-w{world}.json"
        path.write_text(json.dumps(record, indent=1) + "\n")
        record["path"] = str(path)
        print(report(record), flush=True)
    return record


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def report(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    peak = peak_note((r["peak_tflops"] or 0) * 1e12, r["peak_source"])
    return "\n".join([
        f"bench {r['run']}: {r['model_params'] / 1e6:,.1f}M params, {r['parallel']['describe']}, "
        f"{r['precision']}, AC {r['parallel']['activation_checkpoint']}, compile {r['parallel']['compile']}",
        f"  device        {r['device_name']}",
        f"  batch         {r['global_batch']} × {r['seq_len']} tokens (micro {r['micro_batch']} × accum "
        f"{r['grad_accum']} × dp {r['global_batch'] // (r['micro_batch'] * r['grad_accum'])})",
        f"  step time     {r['step_time_s'] * 1e3:,.1f} ms (median of {r['steps']} after {r['warmup']} warm-up)",
        f"  tokens/s      {r['tokens_per_s']:,.0f} total, {r['tokens_per_s_per_device']:,.0f} per device",
        f"  MFU           {mfu}  (vs {peak})",
        *([f"  PP bubble     {100 * r['pipeline_bubble']:.1f}% of the step idle per stage ((p-1)/(v·m+p-1)), "
           f"counted in the MFU"] if r.get("pipeline_bubble") else []),
        f"  peak memory   {r['peak_memory_bytes'] / 2**30:.2f} GiB per rank",
        f"  record        {r.get('path', '-')}",
    ])


def bench_cli(args, cfg: JobConfig) -> int:   # cfg: loaded from args by cli/bench.py, before torch
    root = storage_root(args.root, cfg.run.storage)
    try:
        run_bench(cfg, root, args.steps, args.warmup)
        return 0
    finally:
        D.shutdown()
