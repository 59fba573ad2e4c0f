"""The site's fence for the sockets no authentication guards (docs/security.md, "Listening sockets").

torch's c10d TCPStore binds every address whatever host it is given, gloo's pair listeners and torchft's
Lighthouse answer anyone who connects: on Kubernetes the run's NetworkPolicy fences them; on a Slurm site these
nftables rules do, loaded on each node (a prolog, or the node's firewall with the cluster's nodes as `peers`):
new TCP connections to the fenced ports are accepted from loopback, from the job's nodes and as replies to
connections the node opened; from anyone else they are dropped. Ports in `open_ports` (the authenticated serving
API) stay open to all.

    python -m llmcluster.launch.fence --peers 10.0.0.11,10.0.0.12 [--open 8000] [--ports 1024-65535]

prints the rule set (`nft -f -` loads it, `nft delete table inet llmcluster_fence` removes it). No torch here.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys

from llmcluster.errors import UserError

TABLE = "llmcluster_fence"
FENCED_PORTS = "1024-65535"     # every unprivileged port: the rendezvous port and the ephemeral ones alike


def _ports(text: str) -> str:
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"port range {text!r}: expected N or N-M") from None
    if not 1 <= a <= b <= 65535:
        raise UserError(f"port range {text!r}: expected 1 <= N <= M <= 65535")
    return f"{a}-{b}" if a != b else str(a)


def render_nft(peers: list[str], open_ports: list[int] = (), fenced: str = FENCED_PORTS,
               table: str = TABLE) -> str:
    """The nftables rule set (one `inet` table of its own: loading it touches no other rule) for one node."""
    nets: dict[int, list[str]] = {4: [], 6: []}
    for p in peers:
        try:
            net = ipaddress.ip_network(p.strip(), strict=False)
        except ValueError:
            raise UserError(f"peer {p!r}: expected an address or a CIDR") from None
        nets[net.version].append(str(net))
    if not peers:
        raise UserError("no peers: the job's nodes (addresses or CIDRs) are needed")
    for port in open_ports:
        if not 1 <= int(port) <= 65535:
            raise UserError(f"open port {port}: expected 1..65535")
    lines = [f"table inet {table} {{", "  chain input {",
             "    type filter hook input priority 0; policy accept;",
             '    iif "lo" accept',
             "    ct state established,related accept"]
    for version, family in ((4, "ip"), (6, "ip6")):
        if nets[version]:
            lines.append(f"    {family} saddr {{ {', '.join(nets[version])} }} accept")
    if open_ports:
        lines.append(f"    tcp dport {{ {', '.join(str(int(p)) for p in open_ports)} }} accept")
    lines += [f"    tcp dport {_ports(fenced)} ct state new drop", "  }", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmcluster.launch.fence", description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", required=True, help="comma-separated addresses or CIDRs of the job's nodes")
    ap.add_argument("--open", default="", help="comma-separated ports left open to all (authenticated services)")
    ap.add_argument("--ports", default=FENCED_PORTS, help=f"the fenced port range (default {FENCED_PORTS})")
    args = ap.parse_args(argv)
    try:
        opened = [int(p) for p in args.open.split(",") if p.strip()]
        sys.stdout.write(render_nft([p for p in args.peers.split(",") if p.strip()], opened, args.ports))
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
