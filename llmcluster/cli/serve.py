"""`llmcluster serve plan|start|bench`: size vLLM serving for a model on the cluster's GPUs, launch it as a job,
load an endpoint and measure it (no torch)."""

from __future__ import annotations

from llmcluster.cli.common import add_actions, add_config_args, add_root_arg
from llmcluster.serve import VLLM_IMAGE


def register(sub) -> None:
    actions = add_actions(sub, "serve", "serve a model with vLLM: size it on the cluster's GPUs (plan), start it as a job (start), measure it (bench)", dest="action")
    plan = actions.add_parser("plan", help="TP degree, dtype/quantization, context and concurrency that fit")
    plan.add_argument("--model", required=True, metavar="RUN_OR_PATH_OR_PRESET",
                      help="an HF Llama directory (config.json; weights optional), a run's export, or a preset")
    plan.add_argument("--cluster", metavar="FILE|NAME",
                      help="cluster spec (default: $LLMCLUSTER_CLUSTER, else ./cluster.yaml)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument("--calibrate", nargs="+", default=[], metavar="BENCH_JSON",
                      help="scale the decode bounds by the efficiency `serve bench` measured on this GPU")
    _job_args(plan, run_plan)
    _register_bench(actions)

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
    st.add_argument("--no-auth", action="store_true",
                    help="serve without an API key (default: a key per job in logs/<name>/api_key, required by vLLM)")
    st.add_argument("--prometheus-namespace", default="monitoring", metavar="NS",
                    help="k8s: the namespace of the Prometheus the NetworkPolicy lets scrape /metrics "
                         "(default monitoring)")
    st.add_argument("--require-lineage", action="store_true",
                    help="refuse an export whose lineage does not verify (`llmcluster lineage MODEL --verify`)")
    st.add_argument("--dry-run", action="store_true", help="print what would be launched; launch nothing")
    _job_args(st, run_start)


def _job_args(p, func) -> None:
    """The serving actions read serve: (and the storage root) from an optional job config."""
    add_config_args(p, required=False)
    add_root_arg(p)
    p.set_defaults(func=func)


def _job_and_root(args):
    from llmcluster.config.load import load_job_config
    from llmcluster.config.cluster_load import storage_root

    cfg = load_job_config(args.config, args.overrides)
    return cfg, storage_root(args.root, cfg.run.storage, getattr(args, "cluster", None))


def run_start(args) -> int:
    from llmcluster.serve.start import build, start

    cfg, root = _job_and_root(args)
    job, k8s = build(args, cfg, root)
    return start(job, dry_run=args.dry_run, timeout=args.timeout, time_limit=args.time, partition=args.partition,
                 k8s=k8s)


def run_plan(args) -> int:
    import json

    from llmcluster.config.cluster_load import load_cluster
    from llmcluster.config.load import load_job_config
    from llmcluster.errors import UserError
    from llmcluster.plan.served_model import resolve_model
    from llmcluster.plan.serving import Box, serve_plan

    job = load_job_config(args.config, args.overrides)
    model = resolve_model(args.model, args.root, job.run.storage)
    result = serve_plan(model, Box.from_cluster(load_cluster(args.cluster).spec), job.serve)
    if args.calibrate and "refusal" not in result:
        from llmcluster.serve.bench import apply_calibration

        apply_calibration(result, args.calibrate)
    if args.json:
        print(json.dumps(result))
    if "refusal" in result:
        raise UserError(result["refusal"])
    if not args.json:
        from llmcluster.plan.serving_report import render

        render(result)
    return 0


def _concurrencies(text: str) -> list[int]:
    import argparse

    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1 or max(out) > 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of integers 1..1024")
    return sorted(set(out))


def _count(text: str) -> int:
    import argparse

    if not text.isdigit() or not 1 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer 1..100000")
    return int(text)


def _register_bench(actions) -> None:
    b = actions.add_parser("bench", help="load an OpenAI endpoint (vLLM): TTFT, TPOT/ITL, latency, throughput")
    b.add_argument("--endpoint", required=True, metavar="URL", help="the API base, e.g. http://HOST:PORT/v1")
    b.add_argument("--name", help="the serving job whose logs/<name>/ gets bench-<time>.json and .png "
                                  "(default: serve-<model>, as `serve start` names it)")
    b.add_argument("--model", help="the served model name (default: the endpoint's first, GET /v1/models)")
    b.add_argument("--concurrency", type=_concurrencies, default=[1, 2, 4], metavar="1,2,4",
                   help="requests in flight, a sweep point each (default 1,2,4)")
    b.add_argument("--requests", type=_count, default=16, metavar="K", help="requests per sweep point (default 16)")
    b.add_argument("--input-len", type=_count, default=32, metavar="N",
                   help="prompt length: words with the project's client, tokens with vLLM's benchmark (default 32)")
    b.add_argument("--output-len", type=_count, default=32, metavar="N",
                   help="tokens generated per request, end of sequence ignored (default 32)")
    b.add_argument("--cluster", metavar="FILE|NAME",
                   help="plan the model on this cluster and record the decode rate as a share of its bound "
                        "(what `serve plan --calibrate` reads)")
    b.add_argument("--plan-model", metavar="RUN_OR_PATH_OR_PRESET",
                   help="the model to plan (default: the directory the endpoint reports serving)")
    b.add_argument("--engine-python", metavar="PY",
                   help="measure with vLLM's own benchmark (`vllm bench serve`) run by this Python (e.g. the one "
                        "scripts/vllm_venv.sh prints); default: the project's client, which needs no engine")
    b.add_argument("--api-key-file", metavar="FILE", help="the server's API key (default: the key of the serving "
                   "job whose recorded endpoint this is, logs/<name>/api_key)")
    b.add_argument("--json", action="store_true", help="print the record as one JSON object")
    _job_args(b, run_bench)


def run_bench(args) -> int:
    import json
    import sys
    from pathlib import Path

    from llmcluster.errors import UserError
    from llmcluster.serve.auth import key_for
    from llmcluster.serve.bench import Endpoint, bench, decode_efficiency, write
    from llmcluster.storage.layout import Storage, check_run_name

    job, root = _job_and_root(args)
    ep = Endpoint(args.endpoint, key=key_for(args.endpoint, root, args.api_key_file))
    served = ep.models()
    entry = next((m for m in served if m["id"] == args.model), None) if args.model else served[0]
    if entry is None:
        raise UserError(f"--model {args.model}: the endpoint serves {', '.join(str(m['id']) for m in served)}")
    model = entry["id"]
    name = check_run_name(args.name or f"serve-{model.rstrip('/').rsplit('/', 1)[-1]}")   # org/model: model
    logs = Storage(root).run_logs(name)
    plan = None
    if args.cluster:   # before the load: a bad --cluster or model is said at once
        from llmcluster.config.cluster_load import load_cluster
        from llmcluster.plan.served_model import resolve_model
        from llmcluster.plan.serving import Box, serve_plan

        ref = args.plan_model or entry.get("root")
        if not isinstance(ref, str):
            raise UserError("--cluster: the endpoint does not say which directory it serves; give --plan-model")
        plan = serve_plan(resolve_model(ref, args.root, job.run.storage),
                          Box.from_cluster(load_cluster(args.cluster).spec), job.serve)

    def progress(p: dict) -> None:
        print(f"concurrency {p['concurrency']}: {p['completed']}/{p['requests']} ok, "
              f"{p['request_throughput_per_s']:.2f} req/s, {p['output_tokens_per_s']:.1f} output tokens/s, "
              f"TTFT p50 {_ms(p['ttft_ms']['p50'])} p99 {_ms(p['ttft_ms']['p99'])}, "
              f"TPOT mean {_ms(p['tpot_ms']['mean'])}, e2e p50 {_ms(p['e2e_ms']['p50'])}",
              file=sys.stderr if args.json else sys.stdout)

    root = entry.get("root")
    tokenizer = root if isinstance(root, str) and Path(root, "tokenizer.json").is_file() else None
    result = bench(ep, model, args.concurrency, args.requests, args.input_len, args.output_len, progress,
                   args.engine_python, tokenizer)
    result["name"] = name
    result["decode"] = decode_efficiency(result["results"], plan)
    out, png = write(result, logs)
    if args.json:
        print(json.dumps(result))
        return 0
    dec = result["decode"]
    if dec["efficiency"] is not None:
        print(f"decode {dec['tokens_per_s']:,.1f} tokens/s for one sequence = {100 * dec['efficiency']:.3g}% of "
              f"the plan's {dec['plan_bound_tokens_per_s']:,.0f} on {dec['gpu']} (serve plan --calibrate {out})")
    print(f"wrote {out}, {png}")
    failed = sum(p["requests"] - p["completed"] for p in result["results"])
    if failed:
        errors = sorted({e for p in result["results"] for e in p["errors"]})
        print(f"error: {failed} requests failed ({'; '.join(errors)[:300]})", file=sys.stderr)
    return 1 if failed else 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f} ms"
