"""`llmcluster serve bench`: the statistics on recorded timings (no server), the decode efficiency that `serve plan
--calibrate` applies, bad input as one line, and a real bench against the session's vLLM server (marker vllm)."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import assert_one_line_error, cli_inprocess, free_port

pytestmark = pytest.mark.timeout(600)


def timing(ttft: float, gaps: list[float], prompt: int = 10, error: str | None = None):
    from llmcluster.serve.bench import Timing

    chunks = [ttft]
    for g in gaps:
        chunks.append(chunks[-1] + g)
    return Timing(prompt, len(chunks), chunks, chunks[-1] + 0.001, error)


def test_statistics_of_recorded_timings():
    from llmcluster.serve.bench import percentile, point_stats

    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 0.7, 0.2, 0.05, 0.9, 0.4]
    for q in (0, 37.5, 50, 99, 100):
        assert abs(percentile(xs, q) - float(np.percentile(xs, q))) < 1e-12
    # 4 requests of 5 tokens each (one chunk a token), one failed; 2 s of wall time
    ok = [timing(0.1, [0.02] * 4), timing(0.2, [0.03] * 4), timing(0.3, [0.01, 0.01, 0.05, 0.05])]
    failed = timing(0.0, [], error="HTTP 500: boom")
    p = point_stats([*ok, failed], concurrency=2, wall_s=2.0)
    assert (p["requests"], p["completed"], p["errors"]) == (4, 3, ["HTTP 500: boom"])
    assert p["request_throughput_per_s"] == 1.5
    assert p["output_tokens_per_s"] == 15 / 2 and p["total_tokens_per_s"] == (15 + 30) / 2
    assert p["ttft_ms"]["mean"] == pytest.approx(200) and p["ttft_ms"]["p50"] == pytest.approx(200)
    assert p["ttft_ms"]["p99"] == pytest.approx(200 + 0.98 * 100)   # 98% of the way from 200 to 300 ms
    # TPOT: (last token - first token) / 4 = the gaps' mean
    tpots = [0.08 / 4, 0.12 / 4, 0.12 / 4]
    assert p["tpot_ms"]["mean"] == pytest.approx(1e3 * sum(tpots) / 3)
    itl = sorted([0.02] * 4 + [0.03] * 4 + [0.01, 0.01, 0.05, 0.05])
    assert p["itl_ms"]["p50"] == pytest.approx(1e3 * float(np.percentile(itl, 50)))
    assert p["itl_ms"]["p99"] == pytest.approx(1e3 * float(np.percentile(itl, 99)))
    assert p["e2e_ms"]["p50"] == pytest.approx(1e3 * (0.2 + 0.12 + 0.001))
    nothing = point_stats([failed], 1, 1.0)
    assert nothing["ttft_ms"] == {"mean": None, "p50": None, "p99": None} and nothing["output_tokens_per_s"] == 0


def _plan_dict(bound: float) -> dict:
    return {"throughput": {"decode_tokens_per_s_bound": bound, "decode_batch_tokens_per_s_bound": 4 * bound,
                           "cluster_decode_tokens_per_s_bound": 8 * bound},
            "cluster": {"name": "box", "gpu": "RTX 4090"}, "serve": {"tp": 1, "dtype": "bfloat16",
                                                                      "quantization": "none"}, "notes": []}


def test_decode_efficiency_is_what_serve_plan_calibrates_with(tmp_path):
    from llmcluster.serve.bench import FORMAT, apply_calibration, decode_efficiency

    points = [{"concurrency": 4, "tpot_ms": {"mean": 40.0}}, {"concurrency": 1, "tpot_ms": {"mean": 25.0}}]
    dec = decode_efficiency(points, _plan_dict(200.0))
    assert dec["tokens_per_s"] == 40.0 and dec["at_concurrency"] == 1 and dec["efficiency"] == 0.2
    assert decode_efficiency(points, None)["efficiency"] is None
    rec = tmp_path / "bench.json"
    rec.write_text(json.dumps({"format": FORMAT, "decode": dec}))
    plan = _plan_dict(300.0)
    apply_calibration(plan, [str(rec)])
    th = plan["throughput"]
    assert th["decode_efficiency"] == 0.2 and th["decode_tokens_per_s_expected"] == pytest.approx(60.0)
    assert th["cluster_decode_tokens_per_s_expected"] == pytest.approx(480.0)
    other = _plan_dict(300.0)
    other["cluster"]["gpu"] = "H200"
    apply_calibration(other, [str(rec)])     # measured on another GPU: not borrowed, said
    assert "decode_efficiency" not in other["throughput"] and "no serve bench record" in other["notes"][0]


def test_serve_plan_calibrate(capsys, tmp_path):
    from llmcluster.serve.bench import FORMAT

    rec = tmp_path / "bench.json"
    rec.write_text(json.dumps({"format": FORMAT, "decode": {"efficiency": 0.5, "tokens_per_s": 100.0,
                                                            "gpu": "RTX4090", "tp": 1, "dtype": "bfloat16"}}))
    args = ("serve", "plan", "--model", "llm_1b", "--cluster", "rtx4090-box", "--json")
    plain = json.loads(cli_inprocess(capsys, *args).stdout)["throughput"]
    proc = cli_inprocess(capsys, *args, "--calibrate", rec)
    assert proc.returncode == 0, proc.stderr
    th = json.loads(proc.stdout)["throughput"]
    assert th["decode_tokens_per_s_expected"] == pytest.approx(plain["decode_tokens_per_s_bound"] / 2)
    assert str(rec) in th["calibrated_from"]
    bad = tmp_path / "train-bench.json"
    bad.write_text(json.dumps({"mfu": 0.4}))
    assert_one_line_error(cli_inprocess(capsys, *args, "--calibrate", bad), "not a `serve bench` record")


class _NoAPI(BaseHTTPRequestHandler):
    def do_GET(self):   # noqa: N802 (http.server's name)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("args, needle", [
    (["--endpoint", "ftp://x/v1"], "expected http(s)://HOST:PORT/v1"),
    (["--endpoint", "http://127.0.0.1:99999/v1"], "not a port number"),
    (["--endpoint", "http://127.0.0.1:1/v1", "--concurrency", "0,2"], "--concurrency"),
    (["--endpoint", "http://127.0.0.1:1/v1", "--requests", "-3"], "--requests"),
    (["--endpoint", "http://127.0.0.1:{closed}/v1"], "no OpenAI API there"),
    (["--endpoint", "http://127.0.0.1:{http}/v1"], "answered 404"),
])
def test_bad_input_is_one_line(capsys, tmp_path, args, needle):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        args = [a.format(closed=free_port(), http=server.server_address[1]) for a in args]
        assert_one_line_error(cli_inprocess(capsys, "serve", "bench", *args, "--root", tmp_path), needle)
    finally:
        server.shutdown()
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
@pytest.mark.vllm
def test_bench_against_the_vllm_server(vllm_server):
    """The real engine: a sweep of two concurrencies writes its JSON and plot beside the job, every request
    answered with the asked-for tokens, and the decode rate set against serve plan's bound on a 4090."""
    from conftest import run_cli

    proc = run_cli("serve", "bench", "--endpoint", vllm_server.base_url, "--name", "bench-test", "--concurrency",
                   "1,2", "--requests", "4", "--input-len", "16", "--output-len", "8", "--cluster", "rtx4090-box",
                   "--root", vllm_server.root, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    files = sorted((Path(vllm_server.root) / "logs" / "bench-test").glob("bench-*"))
    assert [f.suffix for f in files] == [".json", ".png"] and json.loads(files[0].read_text()) == r
    assert [p["concurrency"] for p in r["results"]] == [1, 2]
    for p in r["results"]:
        assert p["completed"] == 4 and all(t["output_tokens"] == 8 for t in p["timings"])
        assert 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"]
        assert p["tpot_ms"]["mean"] > 0 and p["output_tokens_per_s"] > 0
    dec = r["decode"]
    assert dec["gpu"] == "RTX4090" and dec["plan_bound_tokens_per_s"] > 0
    assert dec["efficiency"] == pytest.approx(dec["tokens_per_s"] / dec["plan_bound_tokens_per_s"])


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_benchmark_into_the_same_record(vllm_server):
    """--engine-python: vLLM's own `vllm bench serve` (through the CPU build's metadata shim) measures, and its
    result lands in the same record's fields."""
    from conftest import REPO, run_cli

    engine = subprocess.run(["bash", "scripts/vllm_venv.sh"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.splitlines()[-1]
    proc = run_cli("serve", "bench", "--endpoint", vllm_server.base_url, "--name", "bench-vllm", "--concurrency",
                   "2", "--requests", "4", "--input-len", "16", "--output-len", "8", "--engine-python", engine,
                   "--root", vllm_server.root, "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["settings"]["client"].startswith("vllm bench serve") and r["settings"]["input_unit"] == "tokens"
    (p,) = r["results"]
    assert (p["concurrency"], p["completed"], p["errors"]) == (2, 4, [])
    assert p["output_tokens_per_s"] > 0 and 0 < p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] <= p["e2e_ms"]["p99"]
    assert r["decode"]["tokens_per_s"] == pytest.approx(1e3 / p["tpot_ms"]["mean"])
