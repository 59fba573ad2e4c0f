#!/usr/bin/env bash
# Stop the Prometheus that scripts/prometheus_up.sh started (its pid file), keeping its data for a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.tmp/prometheus}
[ -f "$dir/pid" ] || { echo "no $dir/pid: nothing to stop"; exit 0; }
pid=$(cat "$dir/pid")
if kill -0 "$pid" 2>/dev/null; then
  kill -TERM "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
fi
rm -f "$dir/pid"
echo "prometheus stopped"
