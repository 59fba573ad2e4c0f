"""MFU's denominator: the device peak (datasheet on GPU, the instruction set's on CPU: config/cpus.py). The records
go out through tracking.MetricsProcessor."""

from __future__ import annotations


import torch

from llmcluster.config.gpus import match_device_name


def peak_note(flops: float, source: str) -> str:
    """What MFU is divided by, figure and source: '0.157 TFLOP/s, CPU ISA peak: 2 cores x 2.45 GHz x ...'."""
    return f"{flops / 1e12:.3g} TFLOP/s, {source}" if flops else source


def device_peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(FLOP/s, where the figure comes from) for MFU: the datasheet peak on GPU, the instruction set's on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = match_device_name(name)
        if spec is not None:
            key = "tf32" if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 else precision
            return spec.peak_tflops(key) * 1e12, f"{spec.name} datasheet {key} peak"
        return 0.0, f"unknown GPU {name!r}: no datasheet peak"
    from llmcluster.config.cpus import this_cpu_peak

    # a bound the rank cannot pass (cores x clock x FLOP/cycle), not a matmul timed under whatever load there is
    return this_cpu_peak(torch.get_num_threads(), precision)


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
