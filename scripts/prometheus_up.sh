#!/usr/bin/env bash
# A throwaway Prometheus on 127.0.0.1 scraping this machine's exporter (9400) and trainer port (9401),
# with our recording and alert rules: try the alerts and the dashboards' queries without a cluster.
#   bash scripts/prometheus_up.sh [DIR]     # state in DIR (default .tmp/prometheus); UI on 127.0.0.1:9090
#   bash scripts/prometheus_down.sh [DIR]
# Needs Debian's `prometheus` package (scripts/install_system_deps.sh). Ports: PROM_PORT, NODE_PORT, TRAIN_PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.tmp/prometheus}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
command -v prometheus >/dev/null || { echo "prometheus not installed: bash scripts/install_system_deps.sh" >&2; exit 1; }
mkdir -p "$dir/data"
"$PY" -m llmcluster monitor config --nodes 127.0.0.1 --port "${NODE_PORT:-9400}" --train-port "${TRAIN_PORT:-9401}" \
  --scrape-interval 5s --out "$dir/prometheus.yml"
promtool check config "$dir/prometheus.yml" >/dev/null
nohup prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
  --web.listen-address="127.0.0.1:${PROM_PORT:-9090}" >"$dir/prometheus.log" 2>&1 &
echo $! >"$dir/pid"
for _ in $(seq 50); do
  curl -sf "http://127.0.0.1:${PROM_PORT:-9090}/-/ready" >/dev/null && { echo "prometheus ready: http://127.0.0.1:${PROM_PORT:-9090} (pid $(cat "$dir/pid"), log $dir/prometheus.log)"; exit 0; }
  kill -0 "$(cat "$dir/pid")" 2>/dev/null || { echo "prometheus exited:" >&2; tail -5 "$dir/prometheus.log" >&2; exit 1; }
  sleep 0.2
done
echo "prometheus not ready after 10 s; see $dir/prometheus.log" >&2; exit 1
