"""The `llmcluster` command: parse, dispatch, and turn bad input into one line + exit 2.

Each subcommand lives in its own small module here that only declares its arguments and imports the
capability that does the work lazily, so `llmcluster plan` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from llmcluster import __version__
from llmcluster.errors import EXIT_INTERRUPTED, EXIT_USAGE, RunFailure, UserError, unnamed_disk_full

# (module under llmcluster.cli, in --help order)
_COMMAND_MODULES = (
    "storage", "data", "train", "bench", "export", "lineage", "generate", "eval",
    "cluster", "plan", "serve", "launch", "jobs", "validate", "monitor", "provision",
)


def say(line: str) -> None:
    """One line on stderr in one write: the ranks of a job share the stream, and print() writes the text and
    its newline separately, so two ranks' lines could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage + error; we print one line and exit 2."""

    def error(self, message: str):  # noqa: D401
        say(f"{self.prog}: error: {' '.join(message.split())}")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = OneLineParser(
        prog="llmcluster",
        description="Plan, validate, train on, launch, monitor and manage the storage of an LLM cluster.",
    )
    parser.add_argument("--version", action="version", version=f"llmcluster {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True
    for name in _COMMAND_MODULES:
        importlib.import_module(f"llmcluster.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = run(argv)
    if argv is None:  # a process of its own (the console script, `python -m llmcluster`), not a caller's call
        leave_past_distributed_teardown(code)
        # The interpreter's exit runs collections over every object the imports made (after torch ~0.5 s of CPU,
        # ~1 s with DCP and dynamo); frozen, they are skipped. atexit handlers and refcount frees run as before;
        # only objects in reference cycles are left to the OS (Python never promised their __del__ at exit).
        gc.freeze()
    return code


def leave_past_distributed_teardown(code: int) -> None:
    """A process whose work tore down a torch.distributed group ends here with os._exit once its streams are
    flushed: see `distributed.process_groups.torn_down` (its work, checkpoints and logs included, is done by then)."""
    d = sys.modules.get("llmcluster.distributed.process_groups")  # never imports torch itself
    if d is not None and d.torn_down[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # what a launcher hands on to the ranks it starts
    try:
        return int(args.func(args) or 0)
    except (UserError, RunFailure) as e:
        say(f"llmcluster {args.command}: error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        say(f"llmcluster {args.command}: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `llmcluster ... | head`
        return 0
    except Exception as e:   # a full disk under a writer without a line of its own (records, logs): still one line
        full = unnamed_disk_full(e)
        if full is None:
            raise
        from llmcluster.storage import exit_reason

        exit_reason.write("fatal", str(full))   # a rank's: a requeue would fill the disk again
        say(f"llmcluster {args.command}: error: {full}")
        return full.exit_code
