"""Run the requested checks on this node or on every rank of a job, gather, compare, report.

Alone: stack and storage run here, the device checks run on each local GPU in turn (or the CPU), and
collectives start `--nproc` local ranks under `torchrun --standalone` (this same command, as a child
that writes JSON). As one rank of a torchrun/srun job: every rank joins the collectives, runs the device
checks on its own GPU, local rank 0 also runs stack and storage; rank 0 gathers everything, compares the
nodes, drains the bad ones if asked, and prints and writes the report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from llmcluster.validate.distributed import Place, current_place, spawn_local
from llmcluster.validate.nccl_semantics import OPS
from llmcluster.validate.result import FAIL, SKIP, CheckResult, skipped
from llmcluster.validate.spec import ValidateSpec, load_spec

CHECKS = ("stack", "collectives", "compute", "memory", "pcie", "storage", "thermal")
DEVICE_CHECKS = ("compute", "memory", "pcie", "thermal")
CHILD_ENV = "LLMCLUSTER_VALIDATE_CHILD"   # set on the ranks we spawn: rank 0 writes JSON, prints nothing


@dataclass
class Options:
    checks: list[str]
    root: Path
    report: Path | None = None        # --report FILE: the JSON report
    json: bool = False                # --json: the report on stdout instead of the tables
    plot: Path | None = None
    quick: bool = False
    nproc: int | None = None
    begin: int | None = None
    end: int | None = None
    factor: float | None = None
    iters: int | None = None
    warmup: int | None = None
    ops: list[str] = field(default_factory=lambda: list(OPS))
    tune: bool = False
    drain: bool = False
    max_drain: int | None = None        # at most this many nodes drained (default: 10% of the nodes, >= 1)
    spec_path: str | None = None
    seconds: float | None = None        # thermal load per GPU
    storage_size: int | None = None

    def sweep_defaults(self, gpu: bool) -> tuple[int, int, float, int, int]:
        """(-b, -e, -f, iters, warmup): nccl-tests-like on GPUs, smaller where gloo on CPU is slow."""
        if gpu:
            b, e, f = (1 << 20, 1 << 30, 4) if self.quick else (1 << 20, 8 << 30, 2)
        else:
            b, e, f = (64 << 10, 4 << 20, 8) if self.quick else (1 << 10, 64 << 20, 4)
        n, w = (5, 2) if self.quick else (20, 5)
        return (self.begin or b, self.end or e, self.factor or f, self.iters or n, self.warmup or w)

    def child_argv(self, json_path: Path) -> list[str]:
        argv = ["validate", "collectives", "--report", str(json_path), "--ops", ",".join(self.ops)]
        for flag, v in (("-b", self.begin), ("-e", self.end), ("-f", self.factor), ("-n", self.iters),
                        ("-w", self.warmup), ("--cluster", self.spec_path)):
            if v is not None:
                argv += [flag, str(v)]
        return argv + (["--quick"] if self.quick else []) + (["--tune"] if self.tune else [])


def run(opts: Options) -> int:
    spec = load_spec(opts.spec_path)
    place = current_place()
    if place.distributed:
        return run_rank(opts, spec, place)
    results: list[CheckResult] = []
    if "stack" in opts.checks:
        from llmcluster.validate.stack import check_stack
        results.append(check_stack(spec, opts.root))
        results[-1].node = place.host
    if "collectives" in opts.checks:
        results.append(spawn_collectives(opts))
    device_checks = [c for c in DEVICE_CHECKS if c in opts.checks]
    if device_checks:
        import torch
        devices = ([torch.device("cuda", i) for i in range(torch.cuda.device_count())]
                   if torch.cuda.is_available() else [torch.device("cpu")])
        label = lambda dev: f"{place.host}:{dev.type}{'' if dev.index is None else dev.index}"  # noqa: E731
        for dev in devices:
            for check in (c for c in device_checks if c != "thermal"):
                r = run_device_check(check, dev, spec, opts)
                r.node = label(dev)
                results.append(r)
        if "thermal" in device_checks:
            # all GPUs under load at once, as in training: a node's cooling is tested, not one GPU's
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(len(devices)) as pool:
                for dev, r in zip(devices, pool.map(lambda d: run_device_check("thermal", d, spec, opts), devices)):
                    r.node = label(dev)
                    results.append(r)
    if "storage" in opts.checks:
        from llmcluster.validate.storage import check_storage
        r = check_storage(opts.root, spec, opts.quick, opts.storage_size, nodes_writing())
        r.node = place.host
        results.append(r)
    return finish(results, opts, spec)


def run_device_check(check: str, device, spec: ValidateSpec, opts: Options) -> CheckResult:
    from llmcluster.validate import compute, thermal

    if check == "compute":
        return compute.check_compute(device, spec, opts.quick)
    if check == "memory":
        return compute.check_memory(device, spec, opts.quick)
    if check == "pcie":
        return compute.check_pcie(device, spec, opts.quick)
    return thermal.check_thermal(device, spec, opts.seconds or (5 if opts.quick else 60))


def spawn_collectives(opts: Options) -> CheckResult:
    """Start --nproc local ranks (default: one per GPU, else 2) and read rank 0's report back."""
    nproc = opts.nproc or _local_gpu_count() or 2
    if nproc < 2:
        return skipped("collectives", "one rank: nothing to communicate with (use --nproc 2 or more)")
    with tempfile.TemporaryDirectory(prefix="llmcluster-validate-") as tmp:
        out = Path(tmp) / "collectives.json"
        proc = spawn_local(nproc, opts.child_argv(out), env={CHILD_ENV: "1"})
        if not out.is_file():
            r = CheckResult("collectives")
            r.add("collectives", FAIL, detail=f"{nproc} local ranks exited {proc.returncode} without a report")
            return r
        doc = json.loads(out.read_text())
    return next(CheckResult.from_dict(c) for c in doc["checks"] if c["check"] == "collectives")


def _local_gpu_count() -> int:
    """GPUs on this node without importing torch (NVML), 0 if none or no driver."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:
        return 0


def run_rank(opts: Options, spec: ValidateSpec, place: Place) -> int:
    import torch.distributed as dist

    from llmcluster.validate.distributed import init_process_group, shutdown
    from llmcluster.validate.nodes import inject_slowness

    device = init_process_group()
    try:
        results = []
        if "collectives" in opts.checks:
            results.append(run_collectives(opts, spec, device, place))
        local: list[CheckResult] = []
        if "stack" in opts.checks and place.local_rank == 0:
            from llmcluster.validate.stack import check_stack
            local.append(check_stack(spec, opts.root))
            local[-1].node = place.host
        for check in (c for c in DEVICE_CHECKS if c in opts.checks):
            local.append(run_device_check(check, device, spec, opts))
            local[-1].node = place.label
        if "storage" in opts.checks and place.local_rank == 0:
            from llmcluster.validate.storage import check_storage
            local.append(check_storage(opts.root, spec, opts.quick, opts.storage_size, nodes_writing()))
            local[-1].node = place.host
        inject_slowness(local, place.rank)
        # objects travel over gloo even in an NCCL job: no GPU copies of pickled bytes
        group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        gathered: list = [None] * place.world_size
        dist.all_gather_object(gathered, [r.to_dict() for r in local], group=group)
        code = 0
        if place.rank == 0:
            results += [CheckResult.from_dict(d) for per_rank in gathered for d in per_rank]
            code = finish(results, opts, spec)
        return 0 if os.environ.get(CHILD_ENV) else code
    finally:
        shutdown()


def run_collectives(opts: Options, spec: ValidateSpec, device, place: Place) -> CheckResult:
    import torch.distributed as dist

    from llmcluster.validate import collectives
    from llmcluster.validate.nccl_semantics import size_sweep

    b, e, f, iters, warmup = opts.sweep_defaults(device.type == "cuda")
    sizes = size_sweep(b, e, f)
    show = place.rank == 0
    on_row = (lambda row: print(f"  {row['op']:<15}{row['bytes']:>13} B  {'in ' if row['inplace'] else 'out'}"
                                f"  {row['time_us']:>10.1f} us  busbw {row['busbw_GBps']:8.3f} GB/s"
                                f"  wrong {row['wrong']}", flush=True)) if show else None
    rows, unsupported = collectives.sweep(opts.ops, sizes, warmup, iters, device, on_row=on_row)
    tuned = None
    if opts.tune:
        if dist.get_backend() == "nccl":
            tuned = collectives.tune(sizes, warmup, iters, device)
        else:
            unsupported["tune"] = "NCCL_ALGO/NCCL_PROTO apply to NCCL only"
    r = collectives.summarize(rows, {k: v for k, v in unsupported.items() if k != "tune"}, spec,
                              dist.get_backend(), place.world_size, warmup, iters, tuned)
    if "tune" in unsupported:
        r.add("tune", SKIP, detail=unsupported["tune"])
    return r      # no node: a collective's result belongs to the job, not to one host


def finish(results: list[CheckResult], opts: Options, spec: ValidateSpec) -> int:
    """Compare nodes, drain if asked, print, write JSON and plots; exit 1 on any FAIL."""
    from llmcluster.validate import nodes, report

    comparison = nodes.compare_nodes(results, spec.tolerance)
    if comparison.items:
        results.append(comparison)
    if opts.drain:
        results.append(drain_capped(results, comparison, opts.max_drain))
    child = os.environ.get(CHILD_ENV)
    if not child and opts.json:          # --json: stdout is the report, and only that
        print(json.dumps(report.report_doc(results), default=str))
    elif not child:
        print(spec.describe())
        report.print_summary(results)
    if opts.report:
        report.write_json(opts.report, results)
        if not child:   # says where it went, as the plots do (on stderr when stdout is the JSON)
            print(f"report: {opts.report}", file=sys.stderr if opts.json else sys.stdout)
    if opts.plot and not child:
        for p in report.write_plots(opts.plot, results):
            print(f"plot: {p}", file=sys.stderr if opts.json else sys.stdout)
    return 1 if any(r.status == FAIL for r in results) else 0


def drain_capped(results: list[CheckResult], comparison: CheckResult, max_drain: int | None, run=None) -> CheckResult:
    """Drain the bad nodes, but not for a shared cause, and never many at once.

    A check that FAILs on every node (a slow shared filesystem, a wrong driver everywhere) is the cluster's
    problem, not a node's: draining would take the whole partition down, so it drains nothing. More
    flagged nodes than `max_drain` (default 10% of the nodes, at least 1) also points at a shared cause:
    none is drained. Either way the scontrol commands are printed for an operator to run."""
    import shlex
    import subprocess

    from llmcluster.validate import nodes
    from llmcluster.validate.result import FAIL, WARN

    hosts = {nodes.host_of(r.node) for r in results if r.node}
    failing: dict[str, set[str]] = {}
    for r in results:
        if r.node and r.status == FAIL:
            failing.setdefault(r.check, set()).add(nodes.host_of(r.node))
    shared = sorted(c for c, on in failing.items() if len(hosts) > 1 and on == hosts)
    kept = [r for r in results if not (r.node and r.check in shared)]
    bad = nodes.nodes_to_drain(kept, comparison)
    cap = max_drain if max_drain is not None else max(1, len(hosts) // 10)
    for host, reason in sorted(bad.items()):
        print("would drain: " if len(bad) > cap else "drain: ", shlex.join(nodes.drain_command(host, reason)))
    if len(bad) > cap:
        r = CheckResult("drain")
        r.add("drain", WARN, f"{len(bad)} > {cap}", f"{len(bad)} of {len(hosts)} nodes flagged, more than "
              f"--max-drain {cap}: a shared cause is likelier; drained none (the commands are above)")
        r.data["commands"] = [nodes.drain_command(h, why) for h, why in sorted(bad.items())]
    else:
        r = nodes.drain(bad, run=run or subprocess.run)
    for check in shared:
        r.add(f"shared {check}", WARN, "not drained",
              f"{check} FAILs on all {len(hosts)} nodes: a shared cause (filesystem, driver, network)")
    return r


def nodes_writing() -> int:
    """How many nodes run the storage check at once (one rank per node does): torchrun's world size over
    its local world size; 1 outside torchrun."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, world // max(local, 1))
