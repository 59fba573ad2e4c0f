"""`llmcluster monitor config`: where Prometheus should scrape, for static nodes, Slurm and Kubernetes.

The node list comes from the cluster spec (`nodes.hosts` of `--cluster FILE|NAME`, else $LLMCLUSTER_CLUSTER, else
./cluster.yaml; ports from its `monitoring:` section), or from the command line:
  --nodes a,b,c            a plain list (hostnames or IPs)
  --slurm-nodelist EXPR    Slurm's compressed hostlist ("gpu[01-04,07]", e.g. from `sinfo -h -o %N`)
and `--kubernetes` instead writes a DaemonSet for the exporter (on the cluster's GPU nodes: its node selector and
tolerations), PodMonitors for it and for the training pods, and a PrometheusRule carrying monitoring/alerts.yml
and the recording rules (prometheus-operator CRDs, as kube-prometheus-stack installs them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from llmcluster.config import strict_yaml
from llmcluster.config.cluster import ClusterSpec, is_duration
from llmcluster.config.hostlist import expand_hostlist  # noqa: F401  (re-exported: monitor config --slurm-nodelist)
from llmcluster.errors import UserError
from llmcluster.monitor.serve_targets import SERVE_JOB, SERVE_LABEL, ServeTarget, scrape_job, scrape_target
from llmcluster.paths import MONITORING_DIR
from llmcluster.render import show_value, yaml_text

RULE_FILES = ("recording.yml", "alerts.yml")
NODE_JOB = "llmcluster-node"
TRAIN_JOB = "llmcluster-train"


def cluster_hosts(cluster: ClusterSpec, source: str) -> list[str]:
    """The scrape targets' host names: the cluster's `nodes.hosts`."""
    if not cluster.hosts:
        raise UserError(f"{source}: the cluster has {cluster.node_count} node(s) but no host names: add nodes.hosts "
                        f"(a list or a Slurm hostlist like gpu[01-{cluster.node_count:02d}]) or use --nodes / "
                        "--slurm-nodelist")
    return cluster.hosts


def prometheus_config(nodes: list[str], port: int, train_port: int | None, train_ports_per_node: int | dict[str, int],
                      scrape_interval: str = "15s", rules_dir: Path | None = MONITORING_DIR,
                      serving: list[ServeTarget] = (), extra_rule_files: list[Path] = ()) -> dict:
    """A complete prometheus.yml: the node exporters, the training ports, the serving endpoints, our rule files."""
    cfg: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
    }
    if rules_dir is not None and all((rules_dir / f).is_file() for f in RULE_FILES):
        cfg["rule_files"] = [str((rules_dir / f).resolve()) for f in RULE_FILES]
    if extra_rule_files:
        cfg.setdefault("rule_files", []).extend(str(Path(f).resolve()) for f in extra_rule_files)
    jobs = [{"job_name": NODE_JOB, "static_configs": [{"targets": [scrape_target(n, port, "node") for n in nodes]}]}]
    if train_port is not None:
        # Every node may run ranks of a job; a port with no trainer behind it is just `up == 0` for this
        # job, which no alert looks at (a run that ends is not an outage). Stalls are caught by the
        # trainer's own last-step timestamp while it is alive.
        per = train_ports_per_node   # one number, or per host (a node with fewer GPUs runs fewer ranks)
        targets = [scrape_target(n, train_port + i, "node") for n in nodes
                   for i in range(per[n] if isinstance(per, dict) else per)]
        jobs.append({"job_name": TRAIN_JOB, "static_configs": [{"targets": targets}]})
    if serving:
        jobs.append(scrape_job(list(serving)))
    cfg["scrape_configs"] = jobs
    return cfg


def _job_label(job: str) -> dict:
    # The operator names jobs "<namespace>/<podmonitor>"; the alerts and dashboards match our job names.
    return {"action": "replace", "targetLabel": "job", "replacement": job}


def kubernetes_manifests(namespace: str, image: str, port: int, train_port_name: str, expected_gpus: int | None,
                         storage_path: str, rules_dir: Path = MONITORING_DIR, node_selector: dict | None = None,
                         tolerations: list[dict] | None = None, extra_groups: list[dict] = ()) -> list[dict]:
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
                    "nodeSelector": node_selector or {"nvidia.com/gpu.present": "true"},
                    "tolerations": tolerations or [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                    "effect": "NoSchedule"}],
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
    pm_serve = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
        "metadata": {"name": SERVE_JOB, "namespace": namespace, "labels": labels},
        # vLLM pods launched by `serve start` carry llmcluster.io/serve=<name> and serve /metrics on port "http".
        "spec": {"selector": {"matchExpressions": [{"key": SERVE_LABEL, "operator": "Exists"}]},
                 "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s",
                                          "relabelings": [_job_label(SERVE_JOB),
                                                          {"action": "replace", "targetLabel": "serve_name",
                                                           "sourceLabels": [_meta_label(SERVE_LABEL)]}]}]},
    }
    groups = list(extra_groups)
    for f in RULE_FILES:
        if not (rules_dir / f).is_file():  # a wheel install has no repo checkout next to the package
            raise UserError(f"rule file {rules_dir / f} not found: run from a checkout of the llmcluster repo")
        groups += strict_yaml.load((rules_dir / f).read_text())["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
        "metadata": {"name": "llmcluster", "namespace": namespace, "labels": labels},
        "spec": {"groups": groups},
    }
    return [daemonset, pm_node, pm_train, pm_serve, rule]


def _meta_label(label: str) -> str:
    """The operator's meta label for a pod label (non-alphanumerics become underscores)."""
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)


def dump(docs: dict | list[dict]) -> str:
    """YAML documents through the boundary (render.yaml_text: a safe dumper, no anchors: people read and
    kubectl-diff these files)."""
    return yaml_text([docs] if isinstance(docs, dict) else docs)


def _check_port(name: str, port: int) -> int:
    if not 0 < port < 65536:
        raise UserError(f"{name} must be a TCP port 1-65535 (got {port})")
    return port


def check_scrape_flags(port: int, train_port: int | None, train_ports_per_node: int, scrape_interval: str) -> None:
    _check_port("--port", port)
    if not is_duration(scrape_interval):
        raise UserError(f"--scrape-interval {show_value(scrape_interval)} is not a Prometheus duration (e.g. 15s, 1m)")
    if train_ports_per_node < 1:
        raise UserError(f"--train-ports-per-node must be >= 1 (got {train_ports_per_node})")
    if train_port is not None:
        _check_port("--train-port", train_port)
        if train_port + train_ports_per_node - 1 > 65535:
            raise UserError("--train-port + --train-ports-per-node runs past port 65535")


def write_text(text: str, out: str | None) -> None:
    """Print, or write the file `out`."""
    if out:
        try:
            Path(out).write_text(text)
        except OSError as e:
            raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    else:
        print(text, end="")
