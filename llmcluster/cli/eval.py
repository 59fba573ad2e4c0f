"""`llmcluster eval`: lm-evaluation-harness on an export, a checkpoint step or a served endpoint (offline);
`eval --compare` tabulates and plots the evaluations of runs and checkpoints."""

from __future__ import annotations

from llmcluster.cli.common import add_root_arg


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate an export, a checkpoint or an endpoint with lm-evaluation-harness "
                                    "(offline; default: the shipped stdlib tasks), or --compare evaluations")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--endpoint", metavar="URL", help="a served model (OpenAI completions API), with --name")
    what.add_argument("--compare", nargs="+", metavar="RUN[:STEP]", help="tabulate the evaluations of runs/steps")
    p.add_argument("--model", metavar="RUN_OR_PATH", help="a run (its export, or --step N) or an export directory")
    p.add_argument("--step", type=int, metavar="N", help="a checkpoint of the run, exported to a temporary directory")
    p.add_argument("--name", metavar="N", help="with --endpoint: the served model's name (its run)")
    p.add_argument("--api-key-file", metavar="FILE", help="with --endpoint: the server's API key (default: the key "
                   "of the serving job whose recorded endpoint this is, logs/<job>/api_key)")
    p.add_argument("--tasks", metavar="T,...", help="shipped task names, task YAML files or harness task names "
                                                    "(default: every shipped task)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--limit", type=int, metavar="N", help="the first N documents of each task only (a smoke run)")
    p.add_argument("--plot", metavar="DIR", help="with --compare: write eval_compare.png (scores against tokens)")
    p.add_argument("--json", action="store_true", help="print the record (--compare: the rows) as JSON")
    add_root_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from llmcluster.errors import UserError

    if args.compare:
        if args.model or args.step is not None or args.name or args.tasks or args.limit is not None:
            raise UserError("--compare reads recorded evaluations: --model, --step, --name, --tasks and --limit "
                            "do not apply")
        from llmcluster.eval.compare import compare_cli

        return compare_cli(args.root, args.compare, as_json=args.json, plot_dir=args.plot)
    if args.plot:
        raise UserError("--plot goes with --compare")
    if args.api_key_file and not args.endpoint:
        raise UserError("--api-key-file goes with --endpoint")
    from llmcluster.eval.evaluate import eval_cli

    return eval_cli(args.root, model=args.model, step=args.step, endpoint=args.endpoint, name=args.name,
                    api_key_file=args.api_key_file, tasks=args.tasks, batch_size=args.batch_size, limit=args.limit,
                    as_json=args.json)
