#!/usr/bin/env bash
# Bring up a real 3-node Slurm on THIS machine, as root, without systemd or cgroups (tests, demos).
# Debian's slurmctld/slurmd/munge packages; one slurmd daemon per node (`slurmd -N n1`, `-N n2`, ...) emulates
# nodes at NodeAddr=127.0.0.1. The names n1..nN resolve nowhere (no /etc/hosts entries), as on sites
# where NodeName is not a hostname. Idempotent: running it again reconfigures what is already up.
#   SLURM_NODES=N   number of emulated nodes (default 3: two for the 2-node jobs, and a spare for ft's
#                   node-loss test, ft.spare_nodes). A cluster already up with more nodes is kept as it is
#                   (changing the node count restarts the daemons, which ends every job on them).
# Stop everything with scripts/slurm_down.sh (by PID file only).
# Adapted from a recipe tested on Debian 12 / Slurm 22.05.
set -euo pipefail
NODES=${SLURM_NODES:-3}
if [ -s /run/slurmctld.pid ] && kill -0 "$(cat /run/slurmctld.pid)" 2>/dev/null; then
  up=$(grep -c '^NodeName=n' /etc/slurm/slurm.conf 2>/dev/null) || true
  [ "${up:-0}" -gt "$NODES" ] && NODES=$up
fi
CPUS=$(nproc)
H=$(hostname -s)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 / NODES ))
export DEBIAN_FRONTEND=noninteractive
log() { echo "[slurm_up $(date +%T)] $*"; }
die() { echo "slurm_up: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts munged, slurmctld, slurmd)"

# 1. packages (the packages' own daemons are not started: a temporary policy-rc.d denies it)
need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd    >/dev/null || need+=(slurmd)
command -v sbatch    >/dev/null || need+=(slurm-client)
command -v munged    >/dev/null || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1
  fi
  log "apt-get install ${need[*]}"
  apt-get update -qq || die "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null || die "apt-get install ${need[*]} failed"
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
fi

# 2. node names do NOT resolve (as on many sites): Slurm reaches the nodes by NodeAddr, and so must every
#    job script (launch reads NodeAddr from `scontrol show node`). A line an older version of this script
#    added to /etc/hosts is removed, in place (/etc/hosts is often a bind mount in containers).
if grep -q "# llmcluster-slurm$" /etc/hosts; then
  hosts=$(grep -v "# llmcluster-slurm$" /etc/hosts || true)
  printf '%s\n' "$hosts" > /etc/hosts
fi

# 3. munge
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged          # forks; PID in /run/munge/munged.pid
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || die "munged is not answering"

# 4. slurm.conf
mkdir -p /etc/slurm /var/spool/slurmctld /var/log/slurm
{
cat <<EOF
ClusterName=llmcluster
SlurmctldHost=${H}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# job-step credential lifetime; also the delay before a requeued job may start again (default 120 s)
AuthInfo=cred_expire=10
SlurmctldPort=6817
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd-%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
EOF
for i in $(seq 1 "$NODES"); do
  echo "NodeName=n$i NodeHostname=${H} NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} > /etc/slurm/slurm.conf.new

# 5. daemons (a fresh controller starts from empty state: no old jobs, job ids from 1)
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf; then
  rm -f /etc/slurm/slurm.conf.new
else
  # node definitions can't be reconfigured live: restart whatever runs with the old file
  if alive /run/slurmctld.pid; then log "slurm.conf changed: restarting"; bash "$(dirname "$0")/slurm_down.sh" --daemons-only; fi
  mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
fi
if alive /run/slurmctld.pid; then
  log "slurmctld already running"
else
  rm -rf /var/spool/slurmctld/*; : > /var/log/slurm/jobcomp.log
  log "starting slurmctld"; slurmctld -c
fi
for i in $(seq 1 "$NODES"); do
  mkdir -p "/var/spool/slurmd-n$i"
  alive "/run/slurmd-n$i.pid" || { log "starting slurmd n$i"; slurmd -N "n$i"; }
done

# 6. wait until every node is idle (a node left DOWN by an earlier run is resumed)
idle=0
for _ in $(seq 150); do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$' || true)
  [ "$idle" -ge "$NODES" ] && break
  sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 ~ /down|drain/ {print $1}' |
    xargs -r -I{} scontrol update NodeName={} State=RESUME 2>/dev/null || true
  sleep 0.2
done
sinfo -N
[ "$idle" -ge "$NODES" ] || die "Slurm nodes not idle (see /var/log/slurm/)"
log "ready: $NODES node(s) x $CPUS CPUs"
