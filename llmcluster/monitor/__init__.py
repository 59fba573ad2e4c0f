"""Monitoring: a per-node Prometheus exporter (GPUs under dcgm-exporter's names, host, storage), the
trainer's `llmcluster_train_*` metrics, scrape configs for static/Slurm/Kubernetes clusters, and a
terminal view. Alert and recording rules and Grafana dashboards live in the repo's monitoring/ folder.

Nothing here imports torch: the exporter runs on nodes and head nodes without the training stack.
"""
