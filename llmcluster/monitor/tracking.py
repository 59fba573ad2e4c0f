"""Where a run's numbers go: one MetricsProcessor, which owns the logging cadence and fans each record out
to its sinks — metrics.jsonl, the console, TensorBoard, Prometheus, W&B, MLflow — so the trainer never
branches per backend. Each run also records what it is (run.json beside metrics.jsonl, and the same dict
in every sink): the resolved config (job.env redacted), the code version, the dataset digest, the
torch/CUDA/NCCL versions and the cluster spec's name.

Only rank 0 writes records; every rank serves its own Prometheus port (its own step time and loss).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage import run_record
from llmcluster.storage.run_record import RUN_JSON



# -- what the run is -------------------------------------------------------------------------------
def run_info(cfg, root: Path, dataset_digest: str, device) -> dict:
    """The run's identity, recorded once per attempt. The code version is the launch record's (`git
    describe` on the head node at launch); a run started with `llmcluster train` directly describes the
    checkout it runs from."""
    import torch

    import llmcluster
    from llmcluster.config.load import saved_config_dict
    from llmcluster.launch.launcher import code_version
    from llmcluster.storage.job_record import read_record

    rec = read_record(root / "logs" / cfg.run.name) or {}
    nccl = None
    if device.type == "cuda" and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:   # no NCCL in this build
            nccl = None
    code = rec.get("code_version") if isinstance(rec.get("code_version"), str) else None
    return {"run": cfg.run.name, "code_version": code or code_version(), "package_version": llmcluster.__version__,
            "dataset": cfg.data.dataset, "dataset_digest": dataset_digest, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl,
            "cluster": rec.get("cluster") if isinstance(rec.get("cluster"), str) else None,
            "launch": rec.get("launch") if isinstance(rec.get("launch"), int) else None,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": saved_config_dict(cfg)}


def scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics record as sinks without nested values take them: `tokens_by_source` as
    `tokens_by_source/<name>`, `val_loss_by_source` likewise; per-rank lists stay in metrics.jsonl."""
    out: dict[str, float] = {}
    for k, v in record.items():
        if k == "step":
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, dict):
            out.update({f"{k}/{s}": float(x) for s, x in v.items() if isinstance(x, (int, float))})
    return out


def flat(d: dict, prefix: str = "") -> dict[str, str]:
    """A nested dict as dotted keys -> text (MLflow params, TensorBoard's summary)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


# -- the sinks -------------------------------------------------------------------------------------
class Sink:
    def start(self, info: dict) -> None: ...
    def write(self, record: dict) -> None: ...
    def close(self, status: str) -> None: ...


class JsonlSink(Sink):
    """metrics.jsonl (appended across attempts) and run.json (this attempt's identity)."""

    def __init__(self, log_dir: Path):
        self.dir = log_dir
        self.file = open(log_dir / "metrics.jsonl", "a", buffering=1)

    def start(self, info: dict) -> None:
        run_record.write(self.dir, info)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def close(self, status: str) -> None:
        self.file.close()


class ConsoleSink(Sink):
    """The live view: a progress bar on a terminal, else one line per record."""

    def __init__(self, total: int, start_step: int, progress: bool):
        self.total, self.start_step, self.t0 = total, start_step, time.time()
        self.bar = None
        if progress and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.task = self.bar.add_task("train", total=total, completed=start_step, info="")
            self.bar.start()

    def eta_s(self, step: int) -> float:
        done = step - self.start_step
        return (time.time() - self.t0) / done * (self.total - step) if done > 0 else float("nan")

    def write(self, r: dict) -> None:
        parts = [f"loss {r['loss']:.4f}"] + ([f"val {r['val_loss']:.4f}"] if "val_loss" in r else [])
        info = " ".join(parts + [f"lr {r['lr']:.2e}", f"{r['tokens_per_s']:,.0f} tok/s", f"mfu {100 * r['mfu']:.1f}%"])
        if self.bar is not None:
            self.bar.update(self.task, completed=r["step"], info=info)
        else:
            eta = self.eta_s(r["step"])
            print(f"step {r['step']}/{self.total} {info}{f' eta {eta / 60:.1f}m' if eta == eta else ''}", flush=True)

    def message(self, text: str) -> None:
        self.bar.console.print(text) if self.bar is not None else print(text, flush=True)

    def close(self, status: str) -> None:
        if self.bar is not None:
            self.bar.stop()


class TensorBoardSink(Sink):
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter   # ImportError: said by the processor

        self.tb = SummaryWriter(str(log_dir / "tensorboard"))

    def start(self, info: dict) -> None:   # markdown: the JSON as a code block
        self.tb.add_text("run", "```\n" + json.dumps(info, indent=1) + "\n```", 0)

    def write(self, record: dict) -> None:
        for k, v in scalars(record).items():
            self.tb.add_scalar(k, v, record["step"])

    def close(self, status: str) -> None:
        self.tb.close()


class WandbSink(Sink):
    """One W&B run per training run (resumed across attempts by a fixed id); $WANDB_MODE=offline writes
    under logs/<run>/wandb for `wandb sync` later."""

    def __init__(self, cfg, log_dir: Path, run: str):
        self.wandb = _import("wandb", "log.wandb")
        self.cfg, self.dir, self.name, self.run = cfg, log_dir, run, None

    def start(self, info: dict) -> None:
        c = self.cfg
        self.run = self.wandb.init(project=c.project, entity=c.entity, mode=c.mode, dir=str(self.dir), name=self.name,
                                   id=_safe_id(self.name), resume="allow", config=info)

    def write(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status in ("FINISHED", "PREEMPTED") else 1)


class MlflowSink(Sink):
    """One MLflow run per training run, found again by its tag on a later attempt: parameters are the
    resolved config and the run's identity (logged once), tags the per-attempt code version."""

    def __init__(self, cfg, root: Path, run: str):
        mlflow = _import("mlflow", "log.mlflow")
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_uri(cfg.tracking_uri, root)
        self.client, self.name, self.experiment, self.id = MlflowClient(self.uri), run, cfg.experiment, None

    def start(self, info: dict) -> None:
        from mlflow.entities import Param

        c = self.client
        exp = c.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else c.create_experiment(self.experiment)
        found = find_mlflow_run(c, exp_id, self.name)
        tags = {"llmcluster.run": self.name, "code_version": str(info["code_version"]),
                "package_version": info["package_version"], "dataset_digest": info["dataset_digest"]}
        if found:
            self.id = found.info.run_id
            c.update_run(self.id, status="RUNNING")
        else:
            self.id = c.create_run(exp_id, run_name=self.name).info.run_id
            params = [Param(k, v[:6000]) for k, v in flat(info).items() if k != "started_at"]
            for i in range(0, len(params), 100):   # MLflow's batch limit
                c.log_batch(self.id, params=params[i:i + 100])
        for k, v in tags.items():
            c.set_tag(self.id, k, v)

    def write(self, record: dict) -> None:
        from mlflow.entities import Metric

        ms = int(time.time() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, ms, record["step"]) for k, v in scalars(record).items()])

    def close(self, status: str) -> None:
        if self.id is not None:
            self.client.set_terminated(self.id, "FINISHED" if status == "FINISHED" else "KILLED")


class PrometheusSink(Sink):
    """llmcluster_train_* over HTTP (every rank its own port); also the checkpoint, bad-step and
    straggler events."""

    def __init__(self, run: str, rank: int, port: int | None, host: str, is_main: bool):
        from llmcluster.monitor.train_metrics import TrainMetrics

        self.m, self.is_main = TrainMetrics(run, rank, port, bind=host), is_main

    def write(self, r: dict) -> None:
        self.m.step(r["step"], r["loss"], r["lr"], r["tokens_per_s"], r["mfu"], r["step_time_s"])
        if self.is_main:
            self.m.rank_step_times(r["rank_step_time_s"])

    def close(self, status: str) -> None:
        self.m.close()


def _import(name: str, key: str):
    try:
        return __import__(name)
    except ImportError:
        raise UserError(f"{key} is set but {name} is not installed (pip install 'llmcluster[{name}]')") from None


def _safe_id(run: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run)[:64]


def find_mlflow_run(client, experiment_id: str, run: str):
    """The MLflow run tagged `llmcluster.run = run`, or None. MLflow's filter grammar has no escape inside a
    quoted value (its parser trims the two quotes and keeps the rest, mlflow/utils/search_utils.py
    _strip_quotes), so a name goes into the filter only when it is a run name of ours (letters, digits and
    ._-: no quote, backslash or space, check_run_name); the tag is compared again here."""
    from llmcluster.config.schema import RUN_NAME_RE

    if not isinstance(run, str) or not RUN_NAME_RE.fullmatch(run):
        return None
    found = client.search_runs([experiment_id], f"tags.`llmcluster.run` = '{run}'", max_results=10)
    return next((r for r in found if r.data.tags.get("llmcluster.run") == run), None)


def mlflow_uri(uri: str | None, root: Path) -> str:
    """The tracking URI: a SQLite file on this node by default. SQLite's locking is unreliable on network
    file systems, so a sqlite store under the (shared) storage root is refused."""
    if uri is None:
        cache = Path(os.environ.get("LLMCLUSTER_CACHE") or Path.home() / ".cache" / "llmcluster")
        cache.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{cache / 'mlflow.db'}"
    if uri.startswith("sqlite:"):
        path = Path(uri.split(":///", 1)[-1] if ":///" in uri else uri.removeprefix("sqlite:"))
        if not path.is_absolute():
            path = Path.cwd() / path
        if path.resolve().is_relative_to(root.resolve()):
            raise UserError(f"log.mlflow.tracking_uri {uri!r} puts SQLite on the shared storage root {root}: "
                            "SQLite locking fails on network file systems; use a node-local path or a server URI")
    return uri


# -- the processor ---------------------------------------------------------------------------------
def log_eval(root: Path, log_dir: Path, record: dict, say=lambda s: print(s, file=sys.stderr)) -> list[str]:
    """`llmcluster eval`'s scores into the sinks the run logs to (its run.json's config says which), as
    eval/<task>/<metric> at the evaluated checkpoint's step: TensorBoard's directory and the MLflow run of the
    training run; on W&B a run of its own (`<run>-eval`, grouped with the training run), because W&B drops a
    step below the last one logged and evaluations come after training. Only a run.json the caller owns is
    followed (read_own_run_json); otherwise one line through `say`. Returns the sinks written."""
    from llmcluster.config.schema import RUN_NAME_RE, LogConfig

    info, why = run_record.read_own(log_dir)
    if why:
        say(f"eval: {why}; the results are in eval.jsonl and the harness's files only")
    try:
        log = LogConfig.model_validate(info["config"]["log"])
    except (ValueError, KeyError, TypeError):   # pydantic's ValidationError is a ValueError
        return []       # not a run of ours (an export from elsewhere, an endpoint): nothing to log to
    step = record.get("step")
    values = {f"eval/{task}/{m}": float(v) for task, r in (record.get("tasks") or {}).items()
              for m, v in (r.get("metrics") or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not isinstance(step, int) or not values:
        return []
    run, done = info.get("run") or log_dir.name, []
    if not isinstance(run, str) or not RUN_NAME_RE.fullmatch(run):
        say(f"eval: {log_dir / RUN_JSON} names the run {str(run)[:80]!r}, not a run name: its sinks are not used")
        return []
    if log.tensorboard:
        tb = TensorBoardSink(log_dir)
        tb.write({"step": step, **values})
        tb.close("FINISHED")
        done.append("tensorboard")
    if log.mlflow is not None:
        from mlflow.entities import Metric

        sink = MlflowSink(log.mlflow, root, run)
        exp = sink.client.get_experiment_by_name(sink.experiment)
        found = exp and find_mlflow_run(sink.client, exp.experiment_id, run)
        if found:
            ms = int(time.time() * 1000)
            sink.client.log_batch(found.info.run_id, metrics=[Metric(k, v, ms, step) for k, v in values.items()])
            done.append("mlflow")
    if log.wandb is not None:
        wandb, c = _import("wandb", "log.wandb"), log.wandb
        r = wandb.init(project=c.project, entity=c.entity, mode=c.mode, dir=str(log_dir), name=f"{run}-eval",
                       id=_safe_id(f"{run}-eval"), resume="allow", group=run, job_type="eval",
                       config={"run": run, "code_version": info.get("code_version")})
        r.define_metric("checkpoint_step")
        r.define_metric("eval/*", step_metric="checkpoint_step")
        r.log({"checkpoint_step": step, **values})
        r.finish()
        done.append("wandb")
    return done


class MetricsProcessor:
    """Rank 0 writes every sink; other ranks only serve Prometheus. `due(step)` is the logging cadence."""

    def __init__(self, cfg, root: Path, log_dir: Path, rank: int, local_rank: int, start_step: int,
                 is_main: bool):
        log = cfg.log
        self.interval, self.is_main = log.interval, is_main
        self.sinks: list[Sink] = []
        self.console = None
        self.prom = None
        self.status = "FAILED"
        self.muted = False   # an ft group that handed the writer's role over
        if log.metrics is not None:    # HOST:PORT; rank r serves PORT + its local rank (0: rank 0, any)
            host, port = log.metrics
            serve = port + local_rank if port else (0 if is_main else None)
            self.prom = PrometheusSink(cfg.run.name, rank, serve, host, is_main)
            self.sinks.append(self.prom)
        if not is_main:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self.console = ConsoleSink(cfg.train.steps, start_step, log.progress)
        self.sinks += [JsonlSink(log_dir), self.console]
        if log.tensorboard:
            try:
                self.sinks.append(TensorBoardSink(log_dir))
            except ImportError:
                print("warning: log.tensorboard=true but tensorboard is not installed", file=sys.stderr)
        if log.wandb is not None:
            self.sinks.append(WandbSink(log.wandb, log_dir, cfg.run.name))
        if log.mlflow is not None:
            self.sinks.append(MlflowSink(log.mlflow, root, cfg.run.name))

    def take_over(self, cfg, log_dir: Path, step: int) -> None:
        """An ft group becomes the run's writer: it appends metrics.jsonl and shows the progress from here.
        W&B, MLflow and TensorBoard stay with the process that started them (docs/fault-tolerance.md)."""
        if self.is_main:
            return
        self.is_main, self.muted = True, False
        if self.console is None:   # never the writer before
            log_dir.mkdir(parents=True, exist_ok=True)
            self.console = ConsoleSink(cfg.train.steps, step, cfg.log.progress)
            self.sinks += [JsonlSink(log_dir), self.console]

    def hand_over(self) -> None:
        """Another group writes from now on: only this rank's Prometheus endpoint goes on."""
        self.is_main, self.muted = False, True

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def start(self, info: dict) -> None:
        for s in self.sinks:
            s.start(info)

    def write(self, record: dict) -> None:
        for s in self.sinks:
            if not self.muted or s is self.prom:
                s.write(record)

    def message(self, text: str) -> None:
        self.console.message(text) if self.console else print(text, flush=True)

    # Prometheus-only events (the other sinks read them from the records and the log)
    def checkpoint(self, step: int, save_s: float) -> None:
        if self.prom:
            self.prom.m.checkpoint(step, save_s, time.time())

    def bad_step(self) -> None:
        if self.prom:
            self.prom.m.bad_step()

    def ft_groups(self, groups: int) -> None:
        if self.prom:   # every group's ranks serve it (each sees the quorum)
            self.prom.m.ft_groups(groups)

    def straggler(self, rank: int | None) -> None:
        if self.prom and self.is_main:
            self.prom.m.straggler(rank)

    def close(self) -> None:
        for s in self.sinks:
            s.close(self.status)
