"""`llmcluster cluster init`: a commented cluster.yaml filled from what this host can see.

Sources, each optional: `scontrol show nodes -o` (node names, CPUs, memory, GPUs from Gres, partition),
`nvidia-smi --query-gpu=name` (the GPU model and count on this host), /sys/class/infiniband (NICs, their rate
and link layer: InfiniBand NDR/HDR or RoCE), and /proc/mounts (the storage root's filesystem). What none of
them says keeps its default and a comment saying so. The text is validated as a ClusterSpec before it is written.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmcluster.config.gpus import match_device_name
from llmcluster.config.hostlist import compress_hostlist
from llmcluster.errors import UserError

Runner = Callable[[list[str]], str | None]     # argv -> stdout, or None when the tool is absent or fails


def run_tool(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


@dataclass
class Facts:
    hosts: list[str] = field(default_factory=list)
    cpus: int | None = None
    memory_gb: float | None = None
    gpus_per_node: int | None = None
    gpu: str | None = None              # table name, or None when nvidia-smi shows none / an unknown model
    gpu_seen: str | None = None         # what nvidia-smi called it
    partition: str | None = None
    fabric: str = "none"
    nics: int | None = None
    storage_root: str = "./storage"
    backend: str = "local"
    found: list[str] = field(default_factory=list)   # which sources answered


def parse_scontrol_nodes(text: str) -> list[dict[str, str]]:
    """`scontrol show nodes -o`: one node per line of KEY=VALUE words."""
    nodes = []
    for line in text.splitlines():
        fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))
        if "NodeName" in fields:
            nodes.append(fields)
    return nodes


def gres_gpus(gres: str) -> int:
    """'gpu:a100:4(S:0-1),shard:8' -> 4; '(null)' -> 0."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _most_common(values):
    values = [v for v in values if v is not None]
    return Counter(values).most_common(1)[0][0] if values else None


def detect(run: Runner = run_tool, sysfs: Path = Path("/sys/class/infiniband"),
           mounts: Path = Path("/proc/mounts"), storage: Path = Path("/storage")) -> Facts:
    f = Facts()
    out = run(["scontrol", "show", "nodes", "-o"])
    nodes = parse_scontrol_nodes(out) if out else []
    if nodes:
        f.found.append(f"scontrol ({len(nodes)} nodes)")
        f.hosts = [n["NodeName"] for n in nodes]
        f.cpus = _most_common(int(n["CPUTot"]) for n in nodes if n.get("CPUTot", "").isdigit())
        mem = _most_common(int(n["RealMemory"]) for n in nodes if n.get("RealMemory", "").isdigit())
        f.memory_gb = round(mem / 1000) if mem else None      # RealMemory is in MB
        f.gpus_per_node = _most_common(gres_gpus(n.get("Gres", "")) for n in nodes)
        f.partition = _most_common(n.get("Partitions", "").split(",")[0] or None for n in nodes)
    out = run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    names = [ln.strip() for ln in (out or "").splitlines() if ln.strip()]
    if names:
        f.found.append(f"nvidia-smi ({len(names)} x {names[0]})")
        f.gpu_seen = names[0]
        spec = match_device_name(names[0])
        f.gpu = spec.name if spec else None
        f.gpus_per_node = f.gpus_per_node or len(names)
    f.fabric, f.nics = detect_fabric(sysfs)
    if f.nics:
        f.found.append(f"{sysfs} ({f.nics} x {f.fabric})")
    if storage.is_dir():
        f.storage_root = str(storage)
        f.backend = mount_backend(mounts, storage)
    elif f.hosts:
        f.storage_root = str(storage)     # a Slurm cluster's root is shared and absolute; the comment says to check
    return f


def detect_fabric(sysfs: Path) -> tuple[str, int | None]:
    """(fabric, NIC count) from the RDMA devices' first port: rate '400 Gb/sec (4X NDR)', link_layer."""
    if not sysfs.is_dir():
        return "none", None
    kinds = []
    for dev in sorted(sysfs.iterdir()):
        port = dev / "ports" / "1"
        try:
            rate = (port / "rate").read_text()
            layer = (port / "link_layer").read_text().strip()
        except OSError:
            continue
        gbit = int(m.group(1)) if (m := re.match(r"\s*(\d+)", rate)) else 0
        if layer == "InfiniBand":
            kinds.append("ib-ndr" if gbit >= 400 else "ib-hdr" if gbit >= 200 else None)
        else:
            kinds.append("roce-400" if gbit >= 400 else "roce-200" if gbit >= 200 else None)
    kinds = [k for k in kinds if k]
    if not kinds:
        return "none", None
    return _most_common(kinds), len(kinds)


def mount_backend(mounts: Path, root: Path) -> str:
    """The filesystem type of the mount holding `root`, as a storage backend."""
    best, fstype = "", ""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return "local"
    for ln in lines:
        parts = ln.split()
        if len(parts) >= 3 and (str(root) == parts[1] or str(root).startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return {"lustre": "lustre", "nfs": "nfs", "nfs4": "nfs", "wekafs": "weka", "gpfs": "gpfs"}.get(fstype, "local")


def render(f: Facts, name: str) -> str:
    """The commented cluster.yaml for these facts."""
    from datetime import datetime, timezone

    def c(text: str, note: str) -> str:      # a value and its comment, comments in one column
        return f"{text:<30} # {note}"

    hosts = compress_hostlist(f.hosts) if f.hosts else None
    gpu = f.gpu or "none"
    gres = f" (scontrol Gres: {f.gpus_per_node} per node)" if f.gpus_per_node and not f.gpu else ""
    gpu_note = (f"nvidia-smi: {f.gpu_seen}" if f.gpu else
                f"nvidia-smi shows {f.gpu_seen!r}, not in the GPU table: name one of config/gpus.py{gres}"
                if f.gpu_seen else
                f"no nvidia-smi here: name the GPU (A100-80GB, H100, H200, RTX4090, L40S) or keep none{gres}")
    gpus = f.gpus_per_node if f.gpu else 0
    root_seen = Path(f.storage_root).is_dir()
    lines = [
        f"# cluster.yaml written by `llmcluster cluster init` on {socket.gethostname()} at "
        f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%MZ}",
        f"# detected: {', '.join(f.found) or 'nothing (no scontrol, nvidia-smi or RDMA devices)'}",
        "# Every key, its default and the commands that read it: docs/cluster.md",
        f"name: {name}",
        "nodes:",
        c(f'  hosts: "{hosts}"', "scontrol show nodes") if hosts else
        c("  count: 1", "not detected: list `hosts:` (a Slurm hostlist) or give the count"),
        "hardware:",
        c(f"  gpu: {gpu}", gpu_note),
        c(f"  gpus_per_node: {gpus}", "scontrol Gres / nvidia-smi" if gpus else "0 with gpu: none = CPU-only"),
    ]
    for key, v, note in (("cpus_per_node", f.cpus, "scontrol CPUTot"),
                         ("memory_gb", f.memory_gb, "scontrol RealMemory (MB / 1000)")):
        lines.append(c(f"  {key}: {v}", note) if v is not None else c(f"  # {key}:", "not detected"))
    lines.append(c(f"  fabric: {f.fabric}", "ib-hdr, ib-ndr, roce-200, roce-400, ethernet, none"
                   + (" (/sys/class/infiniband)" if f.nics else "")))
    if f.nics:
        lines.append(c(f"  nics_per_node: {f.nics}", "RDMA devices on this host"))
    lines += [
        "storage:",
        c(f"  root: {f.storage_root}", "the shared filesystem every node mounts"
          + ("" if root_seen else " (not found on this host: check it)")),
        c(f"  backend: {f.backend}", "lustre, weka, gpfs, nfs, local" + (" (/proc/mounts)" if root_seen else "")),
        c("  # write_GBps: 10", "expected aggregate GB/s; measure it: llmcluster validate storage"),
        "scheduler:",
        c(f"  default: {'slurm' if f.hosts else 'local'}", "what `llmcluster launch` uses without --scheduler"),
    ]
    if f.partition:
        lines += ["  slurm:", c(f"    partition: {f.partition}", "scontrol Partitions")]
    lines += [c("  # kubernetes: {namespace: llm, image: IMAGE}", "for launch --scheduler k8s"),
              c("# validate: {min_busbw_GBps: 180}", "thresholds; every default in docs/cluster.md")]
    return "\n".join(lines) + "\n"


def init_cluster(out: Path, name: str = "cluster", force: bool = False, facts: Facts | None = None) -> str:
    """Write the commented cluster.yaml to `out` (never over an existing file unless `force`); returns the text."""
    from llmcluster.config import strict_yaml
    from llmcluster.config.cluster import ClusterSpec
    from llmcluster.config.load import validate

    if out.exists() and not force:
        raise UserError(f"{out} exists: not overwriting it (--force to replace it, or -o another path)")
    text = render(facts or detect(), name)
    validate(strict_yaml.load(text), ClusterSpec, "cluster init")   # never write a file the loader refuses
    try:
        out.write_text(text)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    return text
