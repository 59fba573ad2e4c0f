"""`llmcluster bench`: throughput benchmark of the training step."""

from __future__ import annotations

from llmcluster.cli.common import add_config_args, add_procs_arg, add_root_arg, launched_ranks


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure training throughput, step time, MFU and peak memory")
    add_config_args(p)
    add_root_arg(p)
    add_procs_arg(p)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps")
    p.set_defaults(func=run)


def run(args) -> int:
    if (code := launched_ranks(args)) is not None:
        return code
    from llmcluster.config.load import load_job_config

    # The job config before the benchmark's imports (torch and more, seconds): bad input is refused at once.
    cfg = load_job_config(args.config, args.overrides)
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.storage.layout import Storage

    root = storage_root(getattr(args, "root", None), cfg.run.storage)
    Storage(root).require_writable(root / "logs" / "bench")   # where its record goes: refused before torch
    from llmcluster.train.bench import bench_cli

    return bench_cli(args, cfg)
