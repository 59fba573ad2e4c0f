"""lm-evaluation-harness driven through its command line, in a venv of its own, with no network.

Why its own venv (scripts/lmeval_venv.sh -> scripts/engine_venv.sh) and not an `[eval]` extra: the harness pulls
some forty packages the project never imports (evaluate, scikit-learn, sacrebleu, rouge-score, sqlitedict,
accelerate, peft, ...) and moves its own floor of `datasets`/`transformers` with each release, while the test
extras keep the floors the project supports (`transformers>=4.44`, `datasets>=2.18`); driven as a separate
program (as vLLM is), its pins never constrain ours, and its command line and results JSON are the interface.

Offline always: the hub, dataset and transformers clients are told so (HF_*_OFFLINE), telemetry is off, and
a model is only ever read from a local directory. The harness's chatter goes to harness.log beside the results.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from llmcluster.errors import RunFailure, UserError

PYTHON_ENV = "LLMCLUSTER_LMEVAL_PYTHON"   # an lm-eval venv's python, instead of building scripts/lmeval_venv.sh's
VENV_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "lmeval_venv.sh"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def harness_python() -> str:
    """$LLMCLUSTER_LMEVAL_PYTHON, else the checkout's keyed venv (built on first use, a few minutes)."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise UserError(f"${PYTHON_ENV}={given}: not an executable python")
        return given
    if not VENV_SCRIPT.is_file():
        raise UserError(f"lm-evaluation-harness: set ${PYTHON_ENV} to a python with lm_eval[api,hf]==0.4.13 "
                        f"(a checkout builds one with scripts/lmeval_venv.sh)")
    proc = subprocess.run(["bash", str(VENV_SCRIPT)], stdout=subprocess.PIPE, text=True)   # its notes: our stderr
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RunFailure(f"could not build the lm-evaluation-harness venv ({VENV_SCRIPT}: exit {proc.returncode})")
    return lines[-1]


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OFFLINE)
    env.pop("PYTHONPATH", None)   # the harness's venv, not ours
    return env


def endpoint_completions_url(url: str) -> str:
    """`--endpoint` as a server's base (http://host:port), its /v1, or its /v1/completions."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise UserError(f"--endpoint {url!r}: give the server's http(s)://host:port[/v1[/completions]]")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/completions"):
        path = (path if path.endswith("/v1") else path + "/v1") + "/completions"
    return f"{parts.scheme}://{parts.netloc}{path}"


def check_endpoint(completions_url: str, name: str, key: str | None = None) -> None:
    """The server answers and serves `name` (its /v1/models), or one line now rather than the harness's retries."""
    import json
    import urllib.error
    import urllib.request

    from llmcluster.serve.auth import headers

    models_url = completions_url.removesuffix("/completions") + "/models"
    try:
        with urllib.request.urlopen(urllib.request.Request(models_url, headers=headers(key)), timeout=30) as r:
            served = [m.get("id") for m in json.load(r).get("data", []) if isinstance(m, dict)]
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as e:
        hint = " (the server wants an API key: --api-key-file)" if getattr(e, "code", None) == 401 else ""
        raise UserError(f"--endpoint: no model list from {models_url} ({getattr(e, 'reason', e)}){hint}") from None
    if name not in served:
        raise UserError(f"--endpoint serves {', '.join(map(str, served)) or 'no model'}, not --name {name}")


def model_arguments(model_dir: Path, endpoint: str | None, name: str | None, max_length: int) -> list[str]:
    """--model/--model_args: the export read by transformers, or the served model (tokenized here, with the
    export's tokenizer, so that multiple choice can score continuations through the server's logprobs)."""
    for v in (str(model_dir), name or "", endpoint or ""):
        if "," in v or "=" in v.replace("://", ""):   # the harness splits model_args on , and =
            raise UserError(f"{v!r}: a path, name or URL with ',' or '=' cannot be handed to the harness")
    if endpoint is None:
        return ["--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32", "--device", "cpu"]
    return ["--model", "local-completions", "--model_args",
            f"model={name},base_url={endpoint},tokenizer_backend=huggingface,tokenizer={model_dir},"
            f"max_length={max_length},num_concurrent=2,max_retries=2"]


# `lm_eval run` with only --include_path's tasks indexed, for a run whose every task is ours (shipped or a task
# file): the harness otherwise indexes its ~14,700 built-in task YAMLs at start, ~14 s of CPU (0.4.13, 2 cores),
# for names nobody asked for. Its CLI has no flag for TaskManager's include_defaults; this is its own entry point.
OWN_TASKS_ONLY = """import sys
from lm_eval.tasks.manager import TaskManager
init = TaskManager.__init__
TaskManager.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "include_defaults": False})
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()"""


def run_harness(python: str, model_args: list[str], tasks: list[str], include_dir: Path, out_dir: Path,
                log: Path, batch_size: int, limit: int | None, api_key: str | None = None,
                own_tasks_only: bool = False) -> Path:
    """Run `lm_eval run` writing under out_dir; returns its results JSON (its samples lie beside it). An endpoint's
    API key goes in the harness's environment (local-completions reads OPENAI_API_KEY), never in its argv or the
    log, which starts with the command. own_tasks_only: every task is in include_dir (OWN_TASKS_ONLY)."""
    from llmcluster.serve.auth import CLIENT_ENV

    entry = ["-c", OWN_TASKS_ONLY] if own_tasks_only else ["-m", "lm_eval"]
    cmd = [python, *entry, "run", *model_args, "--tasks", ",".join(tasks),
           "--include_path", str(include_dir), "--batch_size", str(batch_size), "--output_path", str(out_dir),
           "--log_samples", "--seed", "1234"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    with open(log, "w") as f:
        f.write(" ".join(cmd).replace(OWN_TASKS_ONLY, "'<llmcluster.eval.harness.OWN_TASKS_ONLY>'") + "\n")
        f.flush()
        env = {**offline_env(), **({CLIENT_ENV: api_key} if api_key else {})}
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise RunFailure(f"lm-evaluation-harness failed (exit {proc.returncode}): {_last_error(log)} "
                         f"(log: {log})")
    found = sorted(out_dir.rglob("results_*.json"))
    if not found:
        raise RunFailure(f"lm-evaluation-harness wrote no results under {out_dir} (log: {log})")
    return found[-1]


def _last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def scores(results: dict) -> dict[str, dict]:
    """Per task: {metric: value}, {metric: stderr}, version, samples, harness task hash, from its JSON."""
    out = {}
    for task, vals in results.get("results", {}).items():
        metrics, stderr = {}, {}
        for key, v in vals.items():
            if "," not in key or not isinstance(v, (int, float)):
                continue
            metric, _filter = key.split(",", 1)
            if metric.endswith("_stderr"):
                stderr[metric.removesuffix("_stderr")] = v
            else:
                metrics[metric] = v
        n = results.get("n-samples", {}).get(task, {})
        out[task] = {"metrics": metrics, "stderr": stderr, "version": results.get("versions", {}).get(task),
                     "n": n.get("effective", n.get("original")),
                     "harness_hash": results.get("task_hashes", {}).get(task)}
    return out
