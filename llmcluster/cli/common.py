"""Argument helpers shared by several subcommands (no capability imports here)."""

from __future__ import annotations

import argparse


def add_actions(sub, name: str, help: str, dest: str | None = None, **kw):
    """`llmcluster NAME ACTION ...`: the command's parser with its required ACTION subparsers."""
    p = sub.add_parser(name, help=help)
    actions = p.add_subparsers(dest=dest or f"{name}_cmd", metavar="ACTION", **kw)
    actions.required = True
    return actions


def add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", "-c", required=required, metavar="FILE",
                   help="job config YAML (or a preset name from configs/, e.g. llm_tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted path, e.g. --set train.lr=3e-4 (repeatable)")


def add_root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", metavar="DIR",
                   help="storage root (default: $LLMCLUSTER_STORAGE, else the config's run.storage, else the "
                        "cluster spec's storage.root, else ./storage)")


def add_procs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--procs-per-node", "--nproc-per-node", dest="procs_per_node", type=int, metavar="N",
                   help="start N ranks on this machine (torch's elastic launch, as torchrun --standalone) and "
                        "exit with their code: 2 bad input, 75 preempted, 1 failed")


def launched_ranks(args) -> int | None:
    """The ranks' exit code when --procs-per-node asks this process to start them; None: run here (no flag, or
    this process is one of the ranks, started with the same arguments)."""
    if args.procs_per_node is None:
        return None
    from llmcluster.floor import require_torch

    require_torch()
    from llmcluster.train.procs import launch_ranks, under_launcher

    return None if under_launcher() else launch_ranks(args.argv, args.procs_per_node)
