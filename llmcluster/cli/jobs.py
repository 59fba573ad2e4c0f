"""`llmcluster jobs list|status|logs|cancel|goodput`: the jobs `llmcluster launch` started (any scheduler)."""

from __future__ import annotations

from llmcluster.cli.common import add_actions, add_root_arg


def register(sub) -> None:
    jsub = add_actions(sub, "jobs", "list launched jobs; show the status or logs of one; cancel one")
    ls = jsub.add_parser("list", help="every launched run under the storage root, with its state")
    add_root_arg(ls)
    ls.set_defaults(func=run)
    for name, help_ in (("status", "scheduler state of one run's job"), ("logs", "print its output"),
                        ("cancel", "stop it (the ranks get SIGTERM and checkpoint)")):
        q = jsub.add_parser(name, help=help_)
        q.add_argument("job", metavar="JOB", help="the run name")
        add_root_arg(q)
        if name == "logs":
            q.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
        if name == "status":
            q.add_argument("--json", action="store_true")
        q.set_defaults(func=run)
    g = jsub.add_parser("goodput", help="where the run's time went: productive training and badput by cause")
    g.add_argument("job", metavar="RUN", help="the run name")
    add_root_arg(g)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--plan", metavar="FILE", help="set the plan's predicted breakdown beside it (a plan YAML or name)")
    g.add_argument("--cluster", metavar="FILE|NAME", help="the cluster of --plan (as `llmcluster plan --cluster`)")
    g.add_argument("--plot", metavar="DIR", help="write goodput.png (a stacked bar, and the plan's) into DIR")
    g.add_argument("--textfile", metavar="FILE",
                   help="write the breakdown as Prometheus gauges for node_exporter's textfile collector")
    g.set_defaults(func=goodput)


def goodput(args) -> int:
    from llmcluster.storage import records
    from llmcluster.launch import goodput as gp
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.paths import check_output_path
    from llmcluster.storage.layout import check_run_name

    run = check_run_name(args.job)
    # output paths before any work: a missing folder, a folder, someone else's file -> one line, exit 2
    textfile = check_output_path(args.textfile, "--textfile") if args.textfile else None
    plot_dir = check_output_path(args.plot, "--plot", inside=(gp.PLOT,)) if args.plot else None
    result = gp.run_goodput(storage_root(args.root), run)
    plan = None
    if args.plan:
        from llmcluster.plan.analyse import analyse
        from llmcluster.plan.load import load_plan

        t = analyse(load_plan(args.plan, [], cluster=args.cluster))["time"]
        plan = result["plan"] = {"goodput": t["goodput"], "badput": t["badput"]}
    # beside it: the plan's prediction, else the same model fed with this run's own C, R, MTBF and interval
    label = "plan" if plan else "model"
    plan = plan or result["model"]
    wrote = []
    if textfile:
        gp.write_textfile(result, textfile)
        result["textfile"] = str(textfile)
        wrote.append(result["textfile"])
    if plot_dir:
        result["plot"] = str(gp.plot(result, plot_dir, plan, label))
        wrote.append(result["plot"])
    if args.json:   # one JSON object: never NaN/Infinity (a non-finite figure is null)
        print(records.dumps(result))
    else:
        print(gp.render(result, plan, label=label))
        if wrote:
            print(f"wrote {', '.join(wrote)}")
    return 0


def run(args) -> int:
    from llmcluster.launch import jobs
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.storage.layout import check_run_name

    root = storage_root(args.root)
    if args.jobs_cmd == "list":
        return jobs.list_jobs(root)
    run_name = check_run_name(args.job)
    if args.jobs_cmd == "status":
        return jobs.status(root, run_name, as_json=args.json)
    if args.jobs_cmd == "logs":
        return jobs.logs(root, run_name, follow=args.follow)
    return jobs.cancel(root, run_name)
