"""`llmcluster plan FILE`: will it fit, how fast, how long, how much (pure Python, no torch)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory, step time, run time, checkpoints, network, power and cost of a plan")
    p.add_argument("file", metavar="FILE", help="plan YAML, or the name of a shipped plan (seed-a100-7b, h100-70b-1024, ...)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a plan value by dotted path, e.g. --set cluster.nodes.count=32 (repeatable)")
    p.add_argument("--cluster", metavar="FILE|NAME",
                   help="the cluster to plan on (a cluster.yaml or a shipped one: seed-a100, h200-8x, rtx4090-box); "
                        "default: the plan's cluster: section, else $LLMCLUSTER_CLUSTER, else ./cluster.yaml")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--search", action="store_true",
                   help="rank the layouts the trainer can run that fit (each with its --set overrides)")
    p.add_argument("--emit-config", metavar="FILE",
                   help="write the best --search candidate as a job config for `llmcluster train`")
    p.add_argument("--calibrate", nargs="+", default=[], metavar="BENCH_JSON",
                   help="take the compute efficiency from `llmcluster bench` records of this cluster "
                        "(or the summary.json of `gpu_check.sh --perf`)")
    p.add_argument("--plot", metavar="DIR", help="write memory.png, step.png and cost.png into DIR (with --finetune: "
                                                 "finetune.png, peak GB a GPU of every method against the card)")
    p.add_argument("--finetune", action="store_true",
                   help="the fine-tuning table: full / LoRA fp32 / LoRA bf16 / QLoRA, AdamW or 8-bit, with and without "
                        "offload (a comparison: exits 0 whatever fits)")
    p.set_defaults(func=run)


def run(args) -> int:
    """Exit 0, or EXIT_DOES_NOT_FIT (3) when the plan's own layout does not fit and nothing else was asked for
    (`--search`, `--emit-config` and `--calibrate` answer their own question: exit 0)."""
    from llmcluster.errors import EXIT_DOES_NOT_FIT
    from llmcluster.storage import records
    from llmcluster.plan.analyse import analyse
    from llmcluster.plan.calibration import bench_rows
    from llmcluster.plan.load import load_plan

    if args.plot:   # before any work: a missing folder, a file, someone else's PNG -> one line, exit 2
        from llmcluster.paths import check_output_path
        from llmcluster.plan.plots import FILES, FINETUNE_FILE

        check_output_path(args.plot, "--plot", inside=(FINETUNE_FILE,) if args.finetune else FILES)
    plan = load_plan(args.file, args.overrides, cluster=args.cluster)
    bench = bench_rows(args.calibrate) if args.calibrate else None
    if args.finetune:
        from llmcluster.plan.analyse import efficiency
        from llmcluster.plan.finetune_report import finetune_result, render_finetune

        result = finetune_result(plan, efficiency(plan, bench)[0])
        if args.plot:
            from llmcluster.plan.plots import finetune_plot

            result["plot"] = str(finetune_plot(result, args.plot))
        print(records.dumps(result)) if args.json else render_finetune(result)
        if args.plot and not args.json:
            print(f"wrote {result['plot']}")
        return 0
    if plan.finetune and (args.search or args.emit_config):
        from llmcluster.errors import UserError

        raise UserError("--search and --emit-config rank pre-training layouts; this plan names a fine-tuning method "
                        "(training.lora, training.optimizer or parallel.fsdp_offload): compare methods with --finetune")
    result = analyse(plan, bench)
    if args.search or args.emit_config:
        from llmcluster.plan.search import search

        result["search"] = search(plan, bench)
    if args.emit_config:
        from llmcluster.plan.emit import train_command, write_job_config

        result["emitted_config"] = str(write_job_config(args.emit_config, plan, result["search"][0]))
    if args.plot:
        from llmcluster.plan.plots import plot

        result["plots"] = [str(p) for p in plot(result, args.plot)]
    code = 0 if result["fits"] or args.search or args.emit_config or args.calibrate else EXIT_DOES_NOT_FIT
    if args.json:   # one JSON object, never NaN/Infinity (a non-finite figure is null); `fits` and `reason` on top
        print(records.dumps(result))
        return code
    from llmcluster.plan.report import render, render_search

    if not result["fits"] or result["finetune"]:   # the verdict first (a fine-tuning plan's names its method)
        print(result["reason"])
    render(result)
    if args.search:
        render_search(result["search"])
    if args.emit_config:
        print(f"wrote {result['emitted_config']}: {train_command(result['emitted_config'])}")
    if args.plot:
        print(f"wrote {', '.join(result['plots'])}")
    return code
