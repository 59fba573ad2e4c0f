"""`llmcluster monitor serve`: one Prometheus exporter per node (GPUs via NVML as dcgm-exporter, host, storage)."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from llmcluster.errors import UserError
from llmcluster.monitor.listen import cannot_listen
from llmcluster.monitor.node_metrics import NodeCollector
from llmcluster.monitor.nvml_metrics import GpuCollector

DEFAULT_PORT = 9400  # dcgm-exporter's port: run one or the other on a node, dashboards work with both


def build_registry(storage_root: Path | None, expected_gpus: int | None, nvml=None,
                   hostname: str | None = None) -> tuple[CollectorRegistry, GpuCollector, NodeCollector]:
    gpus = GpuCollector(nvml, hostname=hostname)
    node = NodeCollector(storage_root, expected_gpus, gpus_present=gpus.responding, nvml_up=gpus.error is None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(gpus)
    registry.register(node)
    return registry, gpus, node


def serve(bind: str, port: int, storage_root: Path | None, expected_gpus: int | None,
          stop: threading.Event | None = None) -> int:
    if expected_gpus is not None and expected_gpus < 0:
        raise UserError(f"--expected-gpus must be >= 0 (got {expected_gpus})")
    registry, gpus, node = build_registry(storage_root, expected_gpus)
    # The handlers go in before the "serving" line: whoever reads that line may signal at once.
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        server, _thread = start_http_server(port, addr=bind, registry=registry)
    except OSError as e:
        raise cannot_listen(bind, port, e) from None
    host, actual_port = server.server_address[:2]
    gpu_note = (f"{gpus.count} GPU(s) via NVML" if gpus.error is None else f"GPUs absent ({gpus.error})")
    if expected_gpus is not None:
        gpu_note += f", {expected_gpus} expected"
    areas = ", ".join(a for a, _ in node.areas()) or "none"
    # One line a launcher script (and the tests) can parse for the port when --port 0 was asked for.
    print(f"llmcluster monitor: serving http://{bind}:{actual_port}/metrics; {gpu_note}; "
          f"storage areas: {areas}{f' under {storage_root}' if storage_root else ''}", flush=True)

    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        gpus.close()
    print("llmcluster monitor: stopped", file=sys.stderr, flush=True)
    return 0
