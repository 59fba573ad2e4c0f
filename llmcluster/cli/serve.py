"""`llmcluster serve plan|start`: size vLLM serving for a model on the cluster's GPUs; launch it as a job (no torch)."""

from __future__ import annotations

from llmcluster.cli.common import add_config_args, add_root_arg
from llmcluster.serve.engine import VLLM_IMAGE


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

    st = actions.add_parser("start", help="launch vLLM for an export (local, slurm, k8s), wait for it, check it")
    st.add_argument("--model", required=True, metavar="RUN_OR_PATH",
                    help="an export directory, or a run name (its export under <storage>/models/)")
    st.add_argument("--name", help="the serving job's name (default: serve-<model>)")
    st.add_argument("--cluster", metavar="FILE|NAME",
                    help="cluster spec: GPUs are sized by `serve plan` (default: $LLMCLUSTER_CLUSTER, else ./cluster.yaml)")
    st.add_argument("--scheduler", choices=("local", "slurm", "k8s"), default="local")
    st.add_argument("--engine-python", metavar="PY", help="the python with vllm (default: $LLMCLUSTER_VLLM_PYTHON, "
                    "else the venv `make vllm` built, else python3 on PATH if it has vllm)")
    st.add_argument("--host", help="address to listen on (default: 127.0.0.1 locally, 0.0.0.0 on a cluster)")
    st.add_argument("--port", type=int, help="port (default: a free one locally, from 8000 on a cluster)")
    st.add_argument("--timeout", type=float, default=900, metavar="S", help="wait this long for /health (default 900)")
    st.add_argument("--time", help="Slurm time limit of the serving job (default: the partition's)")
    st.add_argument("--partition", help="Slurm partition")
    st.add_argument("--image", default=VLLM_IMAGE, help=f"k8s: the vLLM image (default {VLLM_IMAGE})")
    st.add_argument("--namespace", help="k8s namespace (default: job.k8s.namespace)")
    st.add_argument("--dry-run", action="store_true", help="print what would be launched; launch nothing")
    add_config_args(st, required=False)
    add_root_arg(st)
    st.set_defaults(func=run_start)


def run_start(args) -> int:
    from llmcluster.config.load import load_job_config
    from llmcluster.paths import resolve_storage_root
    from llmcluster.serve.start import build, start

    cfg = load_job_config(args.config, args.overrides)
    root = resolve_storage_root(args.root, cfg.run.storage)
    job, k8s = build(args, cfg, root)
    return start(job, dry_run=args.dry_run, timeout=args.timeout, time_limit=args.time, partition=args.partition,
                 k8s=k8s)


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
