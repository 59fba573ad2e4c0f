"""`llmcluster eval`: what is evaluated, and where its results go.

A model is an export directory, a run's export (models/<run>/), or a checkpoint step of a run, exported to a
temporary directory of its own (removed after) with the export code; or a served endpoint, read through the
harness's `local-completions` with the run's export as tokenizer. The harness's JSON and samples go to
logs/<run>/eval/step_<N>/ and one line per evaluation to logs/<run>/eval.jsonl: scores and their stderr, each
task's version and digests, and the model's step, tokens seen and dataset digest (from the checkpoint's
train_state.json, the record the trainer keeps of what it trained on).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.eval import harness
from llmcluster.eval.compare import Z95
from llmcluster.eval.tasks import check_harness_tasks, resolve, write_include_dir
from llmcluster.storage import eval_log
from llmcluster.storage.eval_log import EVAL_LOG
from llmcluster.storage.layout import Storage, check_run_name



@dataclass
class Target:
    run: str
    step: int | None
    model_dir: Path                 # the weights read (hf), or the tokenizer of the served model (endpoint)
    source: str                     # what the record names: the export, or the checkpoint exported for this
    endpoint: str | None = None
    api_key: str | None = None      # the endpoint's (serve/auth.py): the harness gets it in its environment
    tokens: int | None = None       # tokens the model had trained on at `step`
    dataset_digest: str | None = None


def eval_dir(root: Path, run: str, step: int | None) -> Path:
    return Storage(root).run_logs(run) / "eval" / (f"step_{step}" if step is not None else "step_unknown")


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _provenance(target: Target, checkpoint: Path | None) -> Target:
    """Tokens seen and dataset digest from the checkpoint's train_state.json, when it is still there."""
    from llmcluster.checkpoint.checkpointer import TRAIN_STATE

    state = _read_json(checkpoint / TRAIN_STATE) if checkpoint else None
    if state:
        try:
            target.tokens = int(state["sampler"]["consumed"]) * int(state["config"]["data"]["seq_len"])
        except (KeyError, TypeError, ValueError):
            pass
        digest = state.get("dataset_digest")
        target.dataset_digest = digest if isinstance(digest, str) else None
    return target


def _from_export(d: Path, run: str | None) -> Target:
    from llmcluster.export.marker import EXPORT_MARKER, is_our_export

    if not (d / "config.json").is_file():
        raise UserError(f"no exported model at {d} (run `llmcluster export --run NAME` first, or give --step N)")
    marker = _read_json(d / EXPORT_MARKER) if is_our_export(d) else None
    step = marker.get("step") if marker else None
    name = run or (marker.get("run") if marker else None) or d.resolve().name
    checkpoint = Path(marker["checkpoint"]) if marker and isinstance(marker.get("checkpoint"), str) else None
    return _provenance(Target(check_run_name(name), step if isinstance(step, int) else None, d, str(d.resolve())),
                       checkpoint)


def _is_path(model: str) -> bool:
    """`--model` names an export directory, not a run (as `generate --model` reads it)."""
    return (Path(model) / "config.json").is_file() or "/" in model


def _export_dir(st: Storage, model: str) -> Path:
    return Path(model) if _is_path(model) else st.model_dir(model)


def resolve_target(root: Path, model: str | None, step: int | None, endpoint: str | None, name: str | None,
                   scratch: Path, api_key_file: str | None = None) -> Target:
    st = Storage(root)
    if endpoint is not None:
        if not name:
            raise UserError("--endpoint needs --name: the model name the server serves (and the run it is)")
        if step is not None:
            raise UserError("--step exports a checkpoint to evaluate; a served endpoint is the export it serves")
        url = harness.endpoint_completions_url(endpoint)
        d = _export_dir(st, model or name)
        if not (d / "tokenizer.json").is_file():
            raise UserError(f"--endpoint: the served model's tokenizer is read from its export: none at {d} "
                            f"(give --model EXPORT_DIR)")
        target = _from_export(d, name)
        from llmcluster.serve.auth import key_for

        target.api_key = key_for(url, root, api_key_file)
        harness.check_endpoint(url, name, target.api_key)
        target.endpoint = url
        return target
    if not model:
        raise UserError("give --model RUN_OR_PATH, --endpoint URL --name N, or --compare RUN[:STEP] ...")
    if _is_path(model) and step is not None:
        raise UserError(f"--step N picks a checkpoint of a run: give the run's name, not the export {model}")
    if step is None:
        return _from_export(_export_dir(st, model), None if _is_path(model) else model)
    run = check_run_name(model)
    from llmcluster.export.hf import export

    out = export(root, run, step, scratch / "model")   # refuses a missing or unverified checkpoint in one line
    return _provenance(Target(run, step, out, str(st.step_dir(run, step))), st.step_dir(run, step))


def evaluate(root: Path, model: str | None = None, step: int | None = None, endpoint: str | None = None,
             name: str | None = None, tasks: str | None = None, batch_size: int = 16,
             limit: int | None = None, api_key_file: str | None = None) -> dict:
    """Run the tasks on the model; returns the record appended to logs/<run>/eval.jsonl."""
    if batch_size < 1 or (limit is not None and limit < 1):
        raise UserError("--batch-size and --limit must be at least 1")
    chosen = resolve(tasks)
    python = None
    if any(t.yaml_text is None for t in chosen):   # a harness task name: known to it? before an export or a start
        python = harness.harness_python()
        check_harness_tasks(chosen, python)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llmcluster-eval-") as tmp:
        scratch = Path(tmp)
        target = resolve_target(root, model, step, endpoint, name, scratch, api_key_file)
        out = Storage(root).require_writable(eval_dir(root, target.run, target.step))
        cfg = _read_json(target.model_dir / "config.json") or {}
        model_args = harness.model_arguments(target.model_dir, target.endpoint, name,
                                             int(cfg.get("max_position_embeddings") or 2048))
        if python is None:   # a first use builds the harness's venv (minutes): not the evaluation's time
            built = time.monotonic()
            python = harness.harness_python()
            t0 += time.monotonic() - built
        log = out / f"harness_{time.strftime('%Y-%m-%dT%H-%M-%S')}.log"   # kept, failed or not
        results_file = harness.run_harness(python, model_args, [t.name for t in chosen],
                                           write_include_dir(chosen, scratch / "tasks"), scratch / "out", log,
                                           batch_size, limit, target.api_key,
                                           own_tasks_only=all(t.yaml_text is not None for t in chosen))
        for f in results_file.parent.iterdir():   # results_<time>.json and samples_<task>_<time>.jsonl
            shutil.move(str(f), out / f.name)
    results = json.loads((out / results_file.name).read_text())
    per_task = harness.scores(results)
    for t in chosen:
        per_task.setdefault(t.name, {}).update(task_digest=t.digest, chance=t.chance)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "run": target.run, "step": target.step,
        "tokens": target.tokens, "dataset_digest": target.dataset_digest,
        "model": target.source,
        "endpoint": target.endpoint, "backend": "local-completions" if target.endpoint else "hf",
        "harness": {"lm_eval": results.get("lm_eval_version"), "transformers": results.get("transformers_version"),
                    "results": str((out / results_file.name).relative_to(root)),
                    "log": str(log.relative_to(root)), "limit": limit},
        "tasks": per_task, "wall_s": round(time.monotonic() - t0, 1),
    }
    logs = Storage(root).run_logs(target.run)
    eval_log.append(logs, record)
    try:    # the run's own sinks too (TensorBoard, MLflow, W&B): the results above are already safe
        from llmcluster.monitor.tracking import log_eval

        log_eval(root, logs, record)     # the record stays what eval.jsonl holds
    except Exception as e:   # a tracking server that is down must not fail an evaluation that is done
        print(f"warning: eval results not sent to the run's tracking sinks: {type(e).__name__}: {e}",
              file=sys.stderr)
    if target.endpoint is None and Path(target.source) == target.model_dir.resolve():   # an export (not a step's)
        refresh_card(target.model_dir, root)
    return record


def refresh_card(export_dir: Path, root: Path) -> None:
    """The export's model card gets this evaluation in its model-index (export/card.py); the results are safe
    already, so a card that cannot be rewritten is a warning."""
    from llmcluster.export.card import refresh_evals

    try:
        refresh_evals(export_dir, root)
    except Exception as e:   # a hand-edited card huggingface_hub cannot parse, a read-only export, a bad record
        print(f"warning: the model card of {export_dir} was not updated: {type(e).__name__}: {e}", file=sys.stderr)


def summary_lines(record: dict) -> list[str]:
    step = "?" if record["step"] is None else record["step"]
    tokens = "" if record["tokens"] is None else f" ({record['tokens']:,} tokens)"
    lines = [f"eval {record['run']} step {step}{tokens} via {record['endpoint'] or record['backend']}: "
             f"{record['wall_s']:.0f} s (± : 95% confidence interval, as `eval --compare` shows)"]
    for task, r in sorted(record["tasks"].items()):
        parts = []
        for metric, v in sorted(r.get("metrics", {}).items()):
            se = r.get("stderr", {}).get(metric)
            parts.append(f"{metric} {v:.4f}" + (f" ± {Z95 * se:.4f}" if isinstance(se, (int, float)) else ""))
        chance = f" (chance {r['chance']:g})" if r.get("chance") else ""
        lines.append(f"  {task}: {', '.join(parts)}{chance}  n={r.get('n')}")
    lines.append(f"results in {Path(record['harness']['results']).parent}/, one line in "
                 f"logs/{record['run']}/{EVAL_LOG}")
    return lines


def eval_cli(root: str | None, **kw) -> int:
    from llmcluster.config.cluster_load import storage_root

    as_json = kw.pop("as_json", False)
    record = evaluate(storage_root(root), **kw)
    if as_json:
        print(json.dumps(record, indent=1))
    else:
        print("\n".join(summary_lines(record)))
    sys.stdout.flush()
    return 0
