#!/usr/bin/env bash
# Install the Debian packages the test suite runs for real (as root; a no-op when present):
#   slurmctld, slurmd, slurm-client, munge  -> the launch tests bring up a 2-node Slurm (scripts/slurm_up.sh)
#   prometheus (ships promtool)             -> the monitor tests scrape our exporter for real
#   python3-apt                             -> the provision tests apply the rendered roles (Ansible's apt module)
#   nftables, iproute2 (ip, ss, tc)         -> the cluster of network namespaces (tests/netcluster.py): loss and
#                                              the site's fence are nftables rules, links and bridges iproute2's
# No daemon is started by the packages: a temporary policy-rc.d denies it; the tests start what they use.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
need=()
command -v slurmctld >/dev/null || need+=(slurmctld slurmd slurm-client)
command -v munged >/dev/null || need+=(munge)
command -v promtool >/dev/null || need+=(prometheus)
/usr/bin/python3 -c 'import apt' 2>/dev/null || need+=(python3-apt)
command -v nft >/dev/null || need+=(nftables)
{ command -v ip && command -v ss && command -v tc; } >/dev/null || need+=(iproute2)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "install_system_deps: need root to apt-get install ${need[*]} (tests that need them will fail)" >&2
  exit 1
fi
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; made_policy=1
fi
echo "install_system_deps: apt-get install ${need[*]}"
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
[ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
exit 0
