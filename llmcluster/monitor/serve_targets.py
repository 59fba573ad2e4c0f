"""Serving endpoints for Prometheus: found in the serving jobs' records, or given on the command line.

`llmcluster serve start` records each serving job in logs/<name>/job.json with `"kind": "serve"` and, once the
engine answers, its `"endpoint"` (http://HOST:PORT/v1) and its `serve.slo.ttft_p99_ms`. vLLM serves its own
`vllm:*` metrics at /metrics on the same port, so the scrape target is that HOST:PORT.

The records live on shared storage, which anyone with write access may have written: a record is data. An
endpoint that is not a plain http URL with a host and a numeric port is skipped with a note, never passed on.
"""

from __future__ import annotations

import ipaddress
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from llmcluster.config.hostlist import HOST_RE
from llmcluster.errors import UserError
from llmcluster.render import line_text, show_value
from llmcluster.storage.job_record import read_record

SERVE_JOB = "llmcluster-serve"
SERVE_LABEL = "llmcluster.io/serve"   # the pod label of a serving Deployment (its value: the job's name)
ENDED = {"CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "PREEMPTED", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
TARGET_RULE = "HOST:PORT with an RFC 1123 host name or an IP address ([v6] in brackets) and a port 1-65535"


def scrape_target(host: str, port, what: str) -> str:
    """HOST:PORT as a Prometheus target, or UserError: the host an RFC 1123 name, an IPv4 address or a bracketed
    IPv6 one, the port 1-65535 (Prometheus would otherwise refuse the whole file, or scrape something else)."""
    host, target = str(host), f"{host}:{port}"
    if host.startswith("[") and host.endswith("]"):
        try:
            ok = isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address)
        except ValueError:
            ok = False
    else:
        ok = bool(HOST_RE.fullmatch(host))     # an IPv4 address is an RFC 1123 name too
    if not ok or not (isinstance(port, int) and 0 < port < 65536):
        raise UserError(f"{what}: scrape target {show_value(target)} is not {TARGET_RULE}")
    return target


@dataclass(frozen=True)
class ServeTarget:
    name: str                          # the serving job's name (label `serve_name` on every scraped series)
    target: str                        # HOST:PORT
    ttft_p99_ms: float | None = None   # the job's SLO: alerts fire above it


def parse_endpoint(url: str) -> str:
    """HOST:PORT of an http(s) endpoint URL (`http://h:8000/v1`), or UserError saying what is wrong."""
    line_text(url.strip(), "serving endpoint")   # urlsplit would drop a tab, CR or LF inside it without a word
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise UserError(f"serving endpoint {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise UserError(f"serving endpoint {url!r} is not http://HOST:PORT[/v1]")
    return scrape_target(parts.netloc.rsplit(":", 1)[0], port, f"serving endpoint {show_value(url)}")


def from_records(root: Path) -> list[ServeTarget]:
    """The serving jobs recorded under root/logs that have not ended, in name order."""
    logs = root / "logs"
    found = []
    for rec_path in sorted(logs.glob("*/job.json")) if logs.is_dir() else []:
        rec = read_record(rec_path.parent)   # the one reader of job.json: its shape checked
        if rec is None or rec.get("kind") != "serve" or rec.get("state") in ENDED:
            continue
        name = rec_path.parent.name
        if not _NAME.fullmatch(name):
            continue
        endpoint = rec.get("endpoint")
        if not isinstance(endpoint, str):
            print(f"monitor config: serving job {name} has no endpoint yet (not healthy?): not scraped",
                  file=sys.stderr)
            continue
        try:
            target = parse_endpoint(endpoint)
        except UserError as e:
            print(f"monitor config: {rec_path}: {e}: not scraped", file=sys.stderr)
            continue
        found.append(ServeTarget(name, target, _slo(rec.get("slo_ttft_p99_ms"))))
    return found


def from_flag(endpoints: str) -> list[ServeTarget]:
    """`--serve-endpoints URL[=NAME],...`: endpoints not launched by us (NAME defaults to HOST:PORT)."""
    out = []
    for item in filter(None, (s.strip() for s in endpoints.split(","))):
        url, _, name = item.partition("=")
        target = parse_endpoint(url)
        name = name or target
        if not _NAME.fullmatch(name.replace(":", "_")):
            raise UserError(f"--serve-endpoints: {show_value(name)} is not a job name (letters, digits, . _ -)")
        out.append(ServeTarget(name, target))
    if not out:
        raise UserError("--serve-endpoints needs at least one URL, e.g. http://gpu01:8000/v1")
    return out


def _slo(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def scrape_job(targets: list[ServeTarget]) -> dict:
    """One Prometheus scrape job for the vLLM endpoints, each target labelled with its job's name."""
    return {"job_name": SERVE_JOB,
            "static_configs": [{"targets": [t.target], "labels": {"serve_name": t.name}} for t in targets]}


def slo_rules(targets: list[ServeTarget]) -> dict | None:
    """A rule group with one TTFT alert per job that set `serve.slo.ttft_p99_ms` (None when no job did).

    PromQL cannot compare a sample with a label, so each job's target is written into its own rule; the
    numbers come from validated floats and the names from the directory names matched above.
    """
    rules = []
    for t in targets:
        if t.ttft_p99_ms is None:
            continue
        seconds = t.ttft_p99_ms / 1000
        rules.append({
            "alert": "ServingTTFTAboveSLO",
            "expr": f'llmcluster:serve_ttft_seconds:p99{{serve_name="{t.name}"}} > {seconds:g}',
            "for": "10m",
            "labels": {"severity": "warning", "serve_name": t.name},
            "annotations": {
                "summary": f"p99 time to first token of {t.name} is {{{{ $value | humanizeDuration }}}} "
                           f"(target {t.ttft_p99_ms:g} ms)",
                "description": "Requests wait for prefill: more replicas or TP, a smaller max_num_seqs, or "
                               "a shorter max_model_len; check ServingQueueGrowing and the KV-cache use.",
            },
        })
    return {"name": "llmcluster-serve-slo", "rules": rules} if rules else None
