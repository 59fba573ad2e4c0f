#!/usr/bin/env bash
# Stop what scripts/slurm_up.sh started, by PID file only (and an /etc/hosts line older versions added).
# Idempotent.
#   --daemons-only   stop slurmctld/slurmd only (slurm_up.sh uses it to restart with a new slurm.conf)
pidfiles=(/run/slurmd-n*.pid /run/slurmctld.pid)
[ "${1:-}" = "--daemons-only" ] || pidfiles+=(/run/munge/munged.pid)
command -v scancel >/dev/null && scancel --quiet --user=root 2>/dev/null || true
sleep 1
for f in "${pidfiles[@]}"; do
  [ -s "$f" ] || continue
  pid=$(cat "$f")
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$f"
done
if [ "${1:-}" != "--daemons-only" ] && grep -q "# llmcluster-slurm$" /etc/hosts 2>/dev/null; then
  hosts=$(grep -v "# llmcluster-slurm$" /etc/hosts)
  printf '%s\n' "$hosts" > /etc/hosts     # in place: /etc/hosts may be a bind mount
fi
exit 0
