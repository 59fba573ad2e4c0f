"""`llmcluster monitor config`: where Prometheus should scrape, for static nodes, Slurm and Kubernetes.

Three sources of the node list, one output shape:
  --nodes a,b,c            a plain list (hostnames or IPs)
  --slurm-nodelist EXPR    Slurm's compressed hostlist ("gpu[01-04,07]", e.g. from `sinfo -h -o %N`)
  --cluster FILE           a cluster spec YAML: `nodes:` (or `hosts:`, also inside a `cluster:` section)
                           as names, a Slurm hostlist, or mappings with name/host and gpus
and `--format kubernetes` instead writes a DaemonSet for the exporter, PodMonitors for it and for the
training pods, and a PrometheusRule carrying monitoring/alerts.yml and the recording rules (prometheus-
operator CRDs, as kube-prometheus-stack installs them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from llmcluster.errors import UserError
from llmcluster.paths import REPO_DIR

MONITORING_DIR = REPO_DIR / "monitoring"
RULE_FILES = ("recording.yml", "alerts.yml")
NODE_JOB = "llmcluster-node"
TRAIN_JOB = "llmcluster-train"
_HOSTLIST_PART = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)")


def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist syntax -> names: 'gpu[01-03,07],login' -> gpu01 gpu02 gpu03 gpu07 login.

    Zero padding follows the range's first bound, as Slurm does. One bracket per name, which is what
    Slurm itself prints for one-dimensional clusters (the only kind GPU clusters use)."""
    names: list[str] = []
    pos = 0
    expr = expr.strip()
    while pos < len(expr):
        m = _HOSTLIST_PART.match(expr, pos)
        if not m or m.end() == pos:
            raise UserError(f"cannot parse Slurm node list {expr!r} near {expr[pos:]!r}")
        prefix, ranges, suffix = m.groups()
        if ranges is None:
            names.append(prefix + suffix)
        else:
            for item in ranges.split(","):
                lo, _, hi = item.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise UserError(f"bad range {item!r} in Slurm node list {expr!r}")
                hi = hi or lo
                if int(hi) < int(lo):
                    raise UserError(f"descending range {item!r} in Slurm node list {expr!r}")
                width = len(lo)
                names.extend(f"{prefix}{n:0{width}d}{suffix}" for n in range(int(lo), int(hi) + 1))
        pos = m.end()
        if pos < len(expr):
            if expr[pos] != ",":
                raise UserError(f"cannot parse Slurm node list {expr!r} near {expr[pos:]!r}")
            pos += 1
    if not names:
        raise UserError("empty Slurm node list")
    return names


def read_cluster_nodes(path: str | Path) -> list[dict[str, Any]]:
    """[{'name': ..., 'gpus': int|None}] from a cluster spec's `nodes:` (names or name/host + gpus)."""
    from llmcluster.config.load import read_yaml

    data = read_yaml(path, what="cluster spec")
    if isinstance(data.get("cluster"), dict):  # a plan file's `cluster:` section, or a spec nested like it
        data = data["cluster"]
    raw = data.get("hosts", data.get("nodes"))
    if isinstance(raw, int) and not isinstance(raw, bool):
        raise UserError(f"{path}: the cluster has {raw} node(s) but no host names: add `hosts:` (a list or a "
                        f"Slurm hostlist like gpu[01-{raw:02d}]) or use --nodes / --slurm-nodelist")
    if isinstance(raw, str):
        raw = expand_hostlist(raw)
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{path}: cluster spec needs a non-empty 'nodes:' (or 'hosts:') list or Slurm hostlist")
    default_gpus = data.get("gpus_per_node")
    nodes = []
    for i, n in enumerate(raw):
        if isinstance(n, str):
            nodes.append({"name": n, "gpus": default_gpus})
        elif isinstance(n, dict) and isinstance(n.get("host", n.get("name")), str):
            gpus = n.get("gpus", default_gpus)
            if gpus is not None and (not isinstance(gpus, int) or gpus < 0):
                raise UserError(f"{path}: nodes[{i}].gpus must be a non-negative integer (got {gpus!r})")
            name = n.get("host", n.get("name"))
            names = expand_hostlist(name) if "[" in name else [name]
            nodes.extend({"name": nm, "gpus": gpus} for nm in names)
        else:
            raise UserError(f"{path}: nodes[{i}] must be a host name or a mapping with 'name' (got {n!r})")
    return nodes


def prometheus_config(nodes: list[str], port: int, train_port: int | None, train_ports_per_node: int,
                      scrape_interval: str = "15s", rules_dir: Path | None = MONITORING_DIR) -> dict:
    """A complete prometheus.yml: the node exporters, the training ports, and our rule files."""
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
    }
    if rules_dir is not None and all((rules_dir / f).is_file() for f in RULE_FILES):
        cfg["rule_files"] = [str((rules_dir / f).resolve()) for f in RULE_FILES]
    jobs = [{"job_name": NODE_JOB, "static_configs": [{"targets": [f"{n}:{port}" for n in nodes]}]}]
    if train_port is not None:
        # Every node may run ranks of a job; a port with no trainer behind it is just `up == 0` for this
        # job, which no alert looks at (a run that ends is not an outage). Stalls are caught by the
        # trainer's own last-step timestamp while it is alive.
        targets = [f"{n}:{train_port + i}" for n in nodes for i in range(train_ports_per_node)]
        jobs.append({"job_name": TRAIN_JOB, "static_configs": [{"targets": targets}]})
    cfg["scrape_configs"] = jobs
    return cfg


def _job_label(job: str) -> dict:
    # The operator names jobs "<namespace>/<podmonitor>"; the alerts and dashboards match our job names.
    return {"action": "replace", "targetLabel": "job", "replacement": job}


def kubernetes_manifests(namespace: str, image: str, port: int, train_port_name: str, expected_gpus: int | None,
                         storage_path: str, rules_dir: Path = MONITORING_DIR) -> list[dict]:
    labels = {"app.kubernetes.io/name": "llmcluster-monitor", "app.kubernetes.io/part-of": "llmcluster"}
    args = ["monitor", "serve", "--bind", "0.0.0.0", "--port", str(port), "--root", "/storage"]
    if expected_gpus is not None:
        args += ["--expected-gpus", str(expected_gpus)]
    daemonset = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "llmcluster-monitor", "namespace": namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": "llmcluster-monitor"}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # Only on GPU nodes; tolerate the taint GPU node pools usually carry.
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "priorityClassName": "system-node-critical",
                    "containers": [{
                        "name": "exporter", "image": image, "command": ["llmcluster"], "args": args,
                        "ports": [{"name": "metrics", "containerPort": port}],
                        # NVML without allocating a GPU: the NVIDIA container runtime mounts the driver's
                        # utility libraries for every device when asked, as for dcgm-exporter.
                        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"}],
                        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                                      "limits": {"memory": "256Mi"}},
                        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}},
                        "volumeMounts": [{"name": "storage", "mountPath": "/storage", "readOnly": True}],
                    }],
                    "volumes": [{"name": "storage", "hostPath": {"path": storage_path, "type": "Directory"}}],
                },
            },
        },
    }
    pm_node = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": NODE_JOB, "namespace": namespace, "labels": labels},
        "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "llmcluster-monitor"}},
                 "podMetricsEndpoints": [{"port": "metrics", "interval": "15s",
                                          "relabelings": [_job_label(NODE_JOB)]}]},
    }
    pm_train = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": TRAIN_JOB, "namespace": namespace, "labels": labels},
        # Training pods (whatever launched them) opt in with the label llmcluster.io/run and a named port.
        "spec": {"selector": {"matchExpressions": [{"key": "llmcluster.io/run", "operator": "Exists"}]},
                 "podMetricsEndpoints": [{"port": train_port_name, "interval": "15s",
                                          "relabelings": [_job_label(TRAIN_JOB)]}]},
    }
    groups = []
    for f in RULE_FILES:
        if not (rules_dir / f).is_file():  # a wheel install has no repo checkout next to the package
            raise UserError(f"rule file {rules_dir / f} not found: run from a checkout of the llmcluster repo")
        groups += yaml.safe_load((rules_dir / f).read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": "llmcluster", "namespace": namespace, "labels": labels},
        "spec": {"groups": groups},
    }
    return [daemonset, pm_node, pm_train, rule]


class _PlainDumper(yaml.SafeDumper):
    """No &id001 anchors for dicts used twice: people read and kubectl-diff these files."""

    def ignore_aliases(self, data):
        return True


def dump(docs: dict | list[dict]) -> str:
    if isinstance(docs, dict):
        docs = [docs]
    return yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False)


_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def _check_port(name: str, port: int) -> int:
    if not 0 < port < 65536:
        raise UserError(f"{name} must be a TCP port 1-65535 (got {port})")
    return port


def write_config(args) -> int:
    """The `monitor config` action: validate the flags, render, print or write."""
    _check_port("--port", args.port)
    if not _DURATION.match(args.scrape_interval):
        raise UserError(f"--scrape-interval {args.scrape_interval!r} is not a Prometheus duration (e.g. 15s, 1m)")
    if args.train_ports_per_node < 1:
        raise UserError(f"--train-ports-per-node must be >= 1 (got {args.train_ports_per_node})")
    train_port = None if args.train_port == -1 else _check_port("--train-port", args.train_port)
    if train_port is not None and train_port + args.train_ports_per_node - 1 > 65535:
        raise UserError("--train-port + --train-ports-per-node runs past port 65535")

    if args.kubernetes:
        text = dump(kubernetes_manifests(args.namespace, args.image, args.port, args.train_port_name,
                                         args.expected_gpus, args.storage_path))
    else:
        if args.nodes is not None:
            nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
            if not nodes:
                raise UserError("--nodes is empty")
        elif args.slurm_nodelist is not None:
            nodes = expand_hostlist(args.slurm_nodelist)
        else:
            nodes = [n["name"] for n in read_cluster_nodes(args.cluster)]
        text = dump(prometheus_config(nodes, args.port, train_port, args.train_ports_per_node,
                                      args.scrape_interval))
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise UserError(f"cannot write {args.out}: {e.strerror or e}") from None
    else:
        print(text, end="")
    return 0
