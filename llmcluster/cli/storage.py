"""`llmcluster storage init|status|push|pull`."""

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
    push_help = ("copy each sealed checkpoint step of RUN newer than the bucket's to BUCKET/RUN/ (each file checked "
                 "against its marker; the marker last)")
    pull_help = ("bring RUN's newest sealed step from a bucket directory or another storage root into this one "
                 "(digests checked; resumes)")
    for name, flag, help_ in (("push", "--to", push_help), ("pull", "--from", pull_help)):
        q = ssub.add_parser(name, help=help_)
        q.add_argument("run", metavar="RUN")
        q.add_argument(flag, dest="where", required=True, metavar="DIR",
                       help="the bucket as a directory (its mount point) or, for pull, a storage root")
        add_root_arg(q)
        q.set_defaults(func=transfer)


def transfer(args) -> int:
    from pathlib import Path

    from llmcluster.config.cluster_load import storage_root
    from llmcluster.storage.layout import check_run_name

    run, root, where = check_run_name(args.run), storage_root(args.root), Path(args.where)
    try:
        return _transfer(args.storage_cmd, run, root, where)
    except OSError as e:   # a full disk, a bucket mount gone: one line
        from llmcluster.errors import UserError
        raise UserError(f"storage {args.storage_cmd} {run}: {e.filename or where}: {e.strerror or e}") from None


def _transfer(cmd: str, run: str, root, where) -> int:
    from llmcluster.storage import bucket

    if cmd == "push":
        steps = bucket.push(root, run, where)
        print(f"pushed {run}: " + (", ".join(f"step_{s}" for s in steps) if steps else "nothing new") + f" to {where}")
        return 0
    step, copied, kept = bucket.pull(where, run, root)
    if step is None:
        print(f"no sealed step of {run} in {where}: nothing to pull")
    elif copied == kept == 0:
        print(f"{run} step_{step} is already here, sealed: nothing to pull")
    else:
        print(f"pulled {run} step_{step}: {copied} file(s) copied, {kept} already here")
    return 0


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
