"""Argument helpers shared by several subcommands (no capability imports here)."""

from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", "-c", required=required, metavar="FILE",
                   help="job config YAML (or a preset name from configs/, e.g. llm_tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted path, e.g. --set train.lr=3e-4 (repeatable)")


def add_root_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", metavar="DIR",
                   help="storage root (default: $LLMCLUSTER_STORAGE, else the config's run.storage, else ./storage)")
