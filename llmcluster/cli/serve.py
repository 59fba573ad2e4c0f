"""`llmcluster serve plan`: size vLLM serving for a model on the cluster's GPUs (pure Python, no torch)."""

from __future__ import annotations

from llmcluster.cli.common import add_config_args, add_root_arg


def register(sub) -> None:
    p = sub.add_parser("serve", help="size vLLM serving of a model on the cluster's GPUs")
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    plan = actions.add_parser("plan", help="TP degree, dtype/quantization, context and concurrency that fit")
    plan.add_argument("--model", required=True, metavar="RUN_OR_PATH_OR_PRESET",
                      help="an HF Llama directory (config.json; weights optional), a run's export, or a preset")
    plan.add_argument("--cluster", metavar="FILE|NAME",
                      help="cluster spec (default: $LLMCLUSTER_CLUSTER, else ./cluster.yaml)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_config_args(plan, required=False)
    add_root_arg(plan)
    plan.set_defaults(func=run_plan)


def run_plan(args) -> int:
    import json

    from llmcluster.config.cluster_load import load_cluster
    from llmcluster.config.load import load_job_config
    from llmcluster.errors import UserError
    from llmcluster.serve.model import resolve_model
    from llmcluster.serve.plan import Box, serve_plan

    job = load_job_config(args.config, args.overrides)
    model = resolve_model(args.model, args.root, job.run.storage)
    result = serve_plan(model, Box.from_cluster(load_cluster(args.cluster).spec), job.serve)
    if args.json:
        print(json.dumps(result))
    if "refusal" in result:
        raise UserError(result["refusal"])
    if not args.json:
        from llmcluster.serve.report import render

        render(result)
    return 0
