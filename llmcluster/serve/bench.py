"""`llmcluster serve bench`: load an OpenAI-compatible endpoint (vLLM) at a sweep of concurrencies and measure it.

The project's own client (stdlib threads + http.client, so it runs from a head node without the engine): each
request streams /v1/completions with greedy decoding and a fixed output length (vLLM's `ignore_eos`), and the
arrival time of every streamed chunk is kept. From those timings, per concurrency:
- TTFT: request sent -> first token; TPOT: (last token - first token) / (output tokens - 1), a request's mean
  decode step (vLLM's benchmark's definitions);
  ITL: the gaps between chunks; end-to-end latency. Each as mean, p50, p99 (linear interpolation, numpy's default).
- request and token throughput: completed requests and output (and prompt + output) tokens over the sweep
  point's wall time.
Every prompt is distinct (a prefix cache would otherwise answer most of the prefill). One warm-up request first.
With `--engine-python`, vLLM's own benchmark measures instead (vllm_bench.py), into the same record.

The decode rate of one sequence, 1000 / mean TPOT at the lowest concurrency, is set against `serve plan`'s memory
bandwidth bound for the model on the cluster (`--cluster`): that ratio is the decode efficiency `serve plan
--calibrate` applies to its bounds (as `plan --calibrate` takes MFU from `llmcluster bench`). No torch.
"""

from __future__ import annotations

import http.client
import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

from llmcluster.errors import UserError
from llmcluster.serve import auth

FORMAT = "llmcluster-serve-bench/1"
WORDS = ("the", "model", "serves", "tokens", "cache", "batch", "queue", "request", "latency", "decode", "prefill",
         "memory", "bandwidth", "kernel", "stream", "server", "client", "context", "length", "value")


@dataclass
class Timing:
    """One request, in seconds from when it was sent (chunks: each streamed chunk's arrival)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None


class Endpoint:
    """An OpenAI API base URL (http://host:port/v1; a bare http://host:port means /v1)."""

    def __init__(self, url: str, timeout: float = 600.0, key: str | None = None):
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UserError(f"--endpoint {url!r}: expected http(s)://HOST:PORT/v1")
        try:
            self.port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            raise UserError(f"--endpoint {url!r}: not a port number") from None
        self.url, self.scheme, self.host = url, u.scheme, u.hostname
        self.path = u.path.rstrip("/") or "/v1"
        self.server = f"{u.scheme}://{u.netloc}"
        self.timeout = timeout
        self.key = key            # the serving job's API key (serve/auth.py), sent as a bearer token

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def models(self) -> list[dict]:
        """GET /models: vLLM's entries carry `root`, the directory it serves."""
        conn = self._conn()
        try:
            conn.request("GET", self.path + "/models", headers=auth.headers(self.key))
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                hint = " (the server wants an API key: --api-key-file)" if resp.status == 401 else ""
                raise UserError(f"--endpoint {self.url}: GET {self.path}/models answered {resp.status}{hint}")
            data = json.loads(body).get("data")
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
            raise UserError(f"--endpoint {self.url}: no OpenAI API there ({e})") from None
        finally:
            conn.close()
        if not isinstance(data, list) or not data or not all(isinstance(m, dict) and "id" in m for m in data):
            raise UserError(f"--endpoint {self.url}: GET {self.path}/models lists no model")
        return data

    def complete(self, model: str, prompt: str, max_tokens: int) -> Timing:
        """One streamed greedy completion of exactly max_tokens tokens, timed."""
        t = Timing()
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}})
        conn = self._conn()
        t0 = time.perf_counter()
        try:
            conn.request("POST", self.path + "/completions", body,
                         {"Content-Type": "application/json", **auth.headers(self.key)})
            resp = conn.getresponse()
            if resp.status != 200:
                t.error = f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"
                return t
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter() - t0
                chunk = json.loads(data)
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    t.chunks.append(now)
                usage = chunk.get("usage")
                if usage:
                    t.prompt_tokens, t.output_tokens = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            t.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        t.e2e = time.perf_counter() - t0
        if t.error is None and not t.chunks:
            t.error = "no tokens streamed"
        return t


def percentile(xs: list[float], q: float) -> float:
    """numpy.percentile's default (linear) on a non-empty list."""
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(xs: list[float]) -> dict[str, float | None]:
    """mean / p50 / p99 in ms of values in seconds (None when there are none)."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": 1e3 * sum(xs) / len(xs), "p50": 1e3 * percentile(xs, 50), "p99": 1e3 * percentile(xs, 99)}


def point_stats(timings: list[Timing], concurrency: int, wall_s: float) -> dict:
    """The figures of one sweep point from its requests' timings and its wall time."""
    ok = [t for t in timings if t.error is None]
    tpot = [(t.chunks[-1] - t.chunks[0]) / (t.output_tokens - 1) for t in ok if t.output_tokens > 1]
    out_tokens = sum(t.output_tokens for t in ok)
    return {
        "concurrency": concurrency, "requests": len(timings), "completed": len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5], "duration_s": wall_s,
        "request_throughput_per_s": len(ok) / wall_s,
        "output_tokens_per_s": out_tokens / wall_s,
        "total_tokens_per_s": (out_tokens + sum(t.prompt_tokens for t in ok)) / wall_s,
        "ttft_ms": summary([t.chunks[0] for t in ok]),
        "tpot_ms": summary(tpot),
        "itl_ms": summary([b - a for t in ok for a, b in zip(t.chunks, t.chunks[1:])]),
        "e2e_ms": summary([t.e2e for t in ok]),
    }


def prompt(i: int, words: int) -> str:
    """A distinct prompt per request (its index first), `words` words long."""
    rng = random.Random(i)
    return f"{i} " + " ".join(rng.choice(WORDS) for _ in range(words - 1))


def run_point(ep: Endpoint, model: str, concurrency: int, requests: int, input_words: int, output_len: int,
              first: int) -> tuple[list[Timing], float]:
    """`requests` completions, `concurrency` in flight at a time; (their timings, the wall time)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        timings = list(pool.map(lambda i: ep.complete(model, prompt(first + i, input_words), output_len),
                                range(requests)))
    return timings, time.perf_counter() - t0


def decode_efficiency(points: list[dict], plan: dict | None) -> dict:
    """One sequence's measured decode rate against the plan's bound (None without a plan or a TPOT)."""
    low = min(points, key=lambda p: p["concurrency"])
    tpot = low["tpot_ms"]["mean"]
    rate = 1e3 / tpot if tpot else None
    out = {"tokens_per_s": rate, "at_concurrency": low["concurrency"], "plan_bound_tokens_per_s": None,
           "efficiency": None, "cluster": None, "gpu": None}
    if plan is not None:
        bound = plan["throughput"]["decode_tokens_per_s_bound"]
        out.update(plan_bound_tokens_per_s=bound, efficiency=None if rate is None else rate / bound,
                   cluster=plan["cluster"]["name"], gpu=plan["cluster"]["gpu"], tp=plan["serve"]["tp"],
                   dtype=plan["serve"]["dtype"], quantization=plan["serve"]["quantization"])
    return out


def bench(ep: Endpoint, model: str, concurrencies: list[int], requests: int, input_len: int, output_len: int,
          progress=lambda point: None, engine_python: str | None = None, tokenizer: str | None = None) -> dict:
    """The sweep: the project's client (input_len in words), or vLLM's benchmark run by `engine_python` (input_len
    in tokens of `tokenizer`, the served model's directory)."""
    if engine_python is None:
        warm = ep.complete(model, prompt(-1, input_len), min(output_len, 4))   # first-request set-up, uncounted
        if warm.error:
            raise UserError(f"--endpoint {ep.url}: the warm-up request failed ({warm.error})")
    elif shutil.which(engine_python) is None:
        raise UserError(f"--engine-python {engine_python}: not an executable")
    elif tokenizer is None:
        raise UserError("--engine-python: vLLM's benchmark tokenizes with the served model's tokenizer, and the "
                        "endpoint's model directory is not readable here")
    points, first = [], 0
    for c in concurrencies:
        if engine_python is None:
            timings, wall = run_point(ep, model, c, requests, input_len, output_len, first)
            first += requests
            p = point_stats(timings, c, wall)
            p["timings"] = [asdict(t) for t in timings]
        else:
            from llmcluster.serve.vllm_bench import run_vllm_bench

            p = run_vllm_bench(engine_python, ep.server, model, tokenizer, c, requests, input_len, output_len,
                               key=ep.key)
        points.append(p)
        progress(p)
    client = "llmcluster (http.client threads)" if engine_python is None else f"vllm bench serve ({engine_python})"
    return {"format": FORMAT, "endpoint": ep.url, "model": model,
            "settings": {"concurrency": concurrencies, "requests": requests, "output_len": output_len,
                         "input_len": input_len, "input_unit": "words" if engine_python is None else "tokens",
                         "client": client},
            "results": points}


def plot(r: dict, path) -> None:
    """Throughput and latency against concurrency (the project's plots: matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = r["results"]
    cs = [p["concurrency"] for p in pts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(cs, [p["output_tokens_per_s"] for p in pts], "o-", label="output tokens/s")
    left.plot(cs, [p["total_tokens_per_s"] for p in pts], "s--", label="prompt + output tokens/s")
    left.set_xlabel("concurrency")
    left.set_ylabel("tokens/s")
    left.set_title(f"{r['model']}: throughput")
    for key, marker in (("ttft_ms", "o"), ("tpot_ms", "s"), ("e2e_ms", "^")):
        for q, line in (("p50", "-"), ("p99", ":")):
            ys = [p[key][q] for p in pts]
            if all(y is not None for y in ys):
                right.plot(cs, ys, marker=marker, linestyle=line, label=f"{key[:-3].upper()} {q}")
    right.set_yscale("log")
    right.set_xlabel("concurrency")
    right.set_ylabel("ms")
    right.set_title("latency")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(r: dict, directory) -> tuple:
    """logs/<name>/bench-<time>.json and .png; (json path, png path)."""
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = d / f"bench-{stamp}.json"
    png = out.with_suffix(".png")
    r["plot"] = str(png)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(r, indent=1))
    tmp.replace(out)
    plot(r, png)
    return out, png


def calibration(paths: list[str], gpu: str) -> tuple[float, str] | None:
    """The decode efficiency of `serve bench` records measured on this GPU (the latest one's), and its source."""
    from pathlib import Path

    found = []
    for path in paths:
        try:
            rec = json.loads(Path(path).read_text(encoding="utf-8"))
            dec = rec["decode"] if rec.get("format") == FORMAT else None
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            dec = None
        if not isinstance(dec, dict):
            raise UserError(f"--calibrate {path}: not a `serve bench` record")
        if not isinstance(dec.get("efficiency"), (int, float)) or dec["efficiency"] <= 0:
            raise UserError(f"--calibrate {path}: the record has no decode efficiency (bench it with --cluster)")
        if dec.get("gpu") == gpu:
            found.append((float(dec["efficiency"]), f"serve bench {path}: {dec['tokens_per_s']:,.1f} tokens/s "
                                                    f"at tp {dec.get('tp')}, {dec.get('dtype')}"))
    return found[-1] if found else None


def apply_calibration(plan: dict, paths: list[str]) -> None:
    """Scale the plan's decode bounds by the measured efficiency (plan['throughput'] gains the expected rates)."""
    th = plan["throughput"]
    got = calibration(paths, plan["cluster"]["gpu"])
    if got is None:
        plan["notes"].append(f"--calibrate: no serve bench record measured on {plan['cluster']['gpu']}; "
                             "the bounds stand uncalibrated")
        return
    eff, source = got
    th["decode_efficiency"], th["calibrated_from"] = eff, source
    for k in ("decode_tokens_per_s", "decode_batch_tokens_per_s", "cluster_decode_tokens_per_s"):
        th[f"{k}_expected"] = eff * th[f"{k}_bound"]
