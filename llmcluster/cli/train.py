"""`llmcluster train`: one process, or every rank under torchrun."""

from __future__ import annotations

from llmcluster.cli.common import add_config_args, add_procs_arg, add_root_arg, launched_ranks


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model from a job config (--procs-per-node N: N ranks on this machine; torchrun across nodes)")
    add_config_args(p)
    add_root_arg(p)
    add_procs_arg(p)
    p.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto: newest complete checkpoint of the run (default); never; or a step directory of the run")
    p.add_argument("--init-from-checkpoint", action="store_true",
                   help="with --resume PATH of another run: start this run from that checkpoint (its weights, "
                        "optimizer and data position); this run's checkpoints above its step are set aside")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from llmcluster.checkpoint.fingerprint import preflight
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.config.load import load_job_config, require_named_run
    from llmcluster.launch.ft_local import supervise
    from llmcluster.launch.spec import LAUNCHES
    from llmcluster.storage.owned import require_own_file

    if args.config and Path(args.config).parent.parent.name == LAUNCHES:   # a launch's config: the caller's own
        require_own_file(Path(args.config), "launch config")
    # The job config and the refusals it and the storage decide, before ranks, torch or the trainer's imports
    # (seconds): bad input is refused at once, in one line, in this process.
    cfg = load_job_config(args.config, args.overrides)
    require_named_run(cfg, args.config)
    if args.init_from_checkpoint and args.resume in ("auto", "never"):
        from llmcluster.errors import UserError

        raise UserError("--init-from-checkpoint starts this run from another run's checkpoint: give it with --resume PATH")
    root = storage_root(args.root, cfg.run.storage)
    preflight(cfg, root, args.resume, args.init_from_checkpoint)
    from llmcluster.storage.layout import Storage

    Storage(root).require_writable(root)   # a read-only or impossible root, refused before torch (issue 69)

    if (code := supervise(args)) is not None:   # ft.enabled: the Lighthouse and one world per replica group
        return code
    if (code := launched_ranks(args)) is not None:
        return code
    from llmcluster.floor import require_torch

    require_torch()
    from llmcluster.train.trainer import train_cli

    return train_cli(args, cfg)
