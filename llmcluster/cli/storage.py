"""`llmcluster storage init|status`."""

from __future__ import annotations

from llmcluster.cli.common import add_actions, add_root_arg


def register(sub) -> None:
    ssub = add_actions(sub, "storage", "create the storage layout and show what is in it")
    i = ssub.add_parser("init", help="create datasets/{code,text,multimodal}, checkpoints/, logs/, models/, scratch/")
    add_root_arg(i)
    i.add_argument("--config", "-c", metavar="FILE", help="take the root from this config's run.storage")
    i.set_defaults(func=run)
    s = ssub.add_parser("status", help="size, files and free space per area; checkpoints per run")
    add_root_arg(s)
    s.add_argument("--config", "-c", metavar="FILE", help="take the root from this config's run.storage")
    s.add_argument("--json", action="store_true", help="print JSON instead of tables")
    s.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.storage import status

    config_root = None
    if args.config:
        from llmcluster.config.load import load_job_config
        config_root = load_job_config(args.config).run.storage
    root = storage_root(args.root, config_root)
    if args.storage_cmd == "init":
        return status.init(root)
    return status.status(root, as_json=args.json)
