"""A cluster on one machine (issue 51): nodes as Linux network namespaces, for the tests one host hides.

Layout, per cluster (names unique per xdist worker and per pytest process, so concurrent sessions never meet):

    <prefix>-br        a namespace holding only the bridge `br0` (not the host's root namespace: nothing the
                       nodes send can be routed off the machine; the bridge namespace has no route anywhere)
    <prefix>-n0 ...    the job's nodes; n0 is the head node. Each has `lo` (up) and `eth0`, a veth whose peer
                       `v<i>` sits on br0, with its own address in a private /24 of the worker's
    <prefix>-out       the outsider: on the same bridge, not a node of the job; its commands run as uid/gid
                       65534 (`setpriv`), since the suite is root and root reads any 0600 secret

Every namespace gets /etc/netns/<ns>/hosts (bind-mounted over /etc/hosts by `ip netns exec`): every node's short
name and FQDN (`n0`, `n0.<domain>`), so names resolve as on a site's DNS; commands run with the node's own UTS
hostname (`unshare --uts` + `hostname`), so `socket.gethostname()` is the node's name, and gloo, which binds the
address its hostname resolves to, binds the node's address.

Faults (each undone by `heal()`, which the fixture calls after every test):
    link_down(node)      the node's bridge port set down: no RST, no FIN, its peers' packets vanish (a hung or
                         cut-off node; SIGKILL would close its sockets at once)
    narrow(node, rate)   a token-bucket (tbf) on both ends of its link
    loss(node, percent)  nftables drops that share of the packets the node receives
    fence(node, ...)     the site's fence (llmcluster.launch.fence's nftables rules) loaded on a node

The fixture removes exactly what it made: its processes, namespaces (their links go with them) and /etc/netns dirs.
In CI (CI=true) or as root, a cluster that cannot be made FAILS the test; it skips only for a developer who is not
root (as tests/slurm_cluster.py).
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NETNS_ETC = Path("/etc/netns")
_SEQ = itertools.count()
NOBODY = "65534"
DOMAIN = "cluster.test"
# run the command under the node's own hostname: a UTS namespace of its own, its hostname set, then exec
_AS_NODE = 'hostname "$0" && exec "$@"'


def worker_index() -> int:
    """gw0 -> 0, gw1 -> 1, ...; the controller (no xdist) -> 0."""
    w = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = "".join(c for c in w if c.isdigit())
    return int(digits or 0)


def _sh(*argv: str, check: bool = True, input: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, input=input, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> {p.returncode}: {p.stderr.strip()}")
    return p


@dataclass
class Node:
    name: str            # short hostname: n0, n1, ..., out
    ns: str              # its network namespace
    addr: str            # its address on the bridge
    port: str            # its veth's peer on the bridge (in the bridge namespace)
    outsider: bool = False

    @property
    def fqdn(self) -> str:
        return f"{self.name}.{DOMAIN}"


@dataclass
class NetCluster:
    """`n_nodes` job nodes (nodes[0] is the head) and one outsider on a bridge of their own. Use as a context
    manager, or call `up()` and `down()`."""
    n_nodes: int = 3
    prefix: str = ""
    short_names: bool = True     # False: the hosts files carry FQDNs only (JobSet pods: a short hostname of a peer
                                 # does not resolve, its FQDN through the headless Service does)
    nodes: list[Node] = field(default_factory=list)
    outsider: Node | None = None
    _made_ns: list[str] = field(default_factory=list)
    _made_etc: list[Path] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _faults: list[tuple] = field(default_factory=list)

    def __post_init__(self):
        w, seq = worker_index(), next(_SEQ)
        self.prefix = self.prefix or f"lct{w}-{os.getpid()}-{seq}"
        # 10.<100+worker>.<pid+n>.0/24: a private subnet per worker (and per cluster); isolated on its own bridge
        self.subnet = ipaddress.ip_network(f"10.{100 + w % 150}.{(os.getpid() + seq) % 250}.0/24")
        self.bridge_ns = f"{self.prefix}-br"

    # -- making and removing --------------------------------------------------------------------------------------
    def up(self) -> "NetCluster":
        hosts = list(self.subnet.hosts())
        try:
            self._add_ns(self.bridge_ns)
            _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            specs = [(f"n{i}", f"{self.prefix}-n{i}", False) for i in range(self.n_nodes)]
            specs.append(("out", f"{self.prefix}-out", True))
            for i, (name, ns, outsider) in enumerate(specs):
                node = Node(name, ns, str(hosts[9 + i]), f"v{i}", outsider)
                self._add_ns(ns)
                _sh("ip", "-n", self.bridge_ns, "link", "add", node.port, "type", "veth", "peer", "name", "eth0",
                    "netns", ns)
                _sh("ip", "-n", self.bridge_ns, "link", "set", node.port, "master", "br0", "up")
                _sh("ip", "-n", ns, "addr", "add", f"{node.addr}/{self.subnet.prefixlen}", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                if outsider:
                    self.outsider = node
                else:
                    self.nodes.append(node)
            for node in self.all_nodes:
                self._write_hosts(node)
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._made_ns.append(ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _write_hosts(self, node: Node) -> None:
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir(parents=True)
            self._made_etc.append(NETNS_ETC)      # removed last, if no one else's dir is in it by then
        d = NETNS_ETC / node.ns
        d.mkdir(exist_ok=False)
        self._made_etc.append(d)
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{n.addr}\t{n.fqdn}" + (f" {n.name}" if self.short_names or n is node else "")
                  for n in self.all_nodes]
        (d / "hosts").write_text("\n".join(lines) + "\n")
        (d / "hostname").write_text(node.name + "\n")

    def down(self) -> None:
        self.stop_all()
        for ns in reversed(self._made_ns):
            _sh("ip", "netns", "delete", ns, check=False)
        for d in reversed(self._made_etc):
            if d == NETNS_ETC:
                try:
                    d.rmdir()
                except OSError:
                    pass
            else:
                shutil.rmtree(d, ignore_errors=True)
        self._made_ns, self._made_etc, self._procs = [], [], []

    def __enter__(self) -> "NetCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- who is where -------------------------------------------------------------------------------------------
    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def all_nodes(self) -> list[Node]:
        return self.nodes + ([self.outsider] if self.outsider else [])

    @property
    def namespaces(self) -> list[str]:
        return list(self._made_ns)

    # -- running commands on a node -----------------------------------------------------------------------------
    def argv(self, node: Node, argv: list[str]) -> list[str]:
        """`argv` as it runs on `node`: in its namespace, under its hostname; on the outsider, as uid 65534."""
        drop = ["setpriv", "--reuid", NOBODY, "--regid", NOBODY, "--clear-groups"] if node.outsider else []
        return ["ip", "netns", "exec", node.ns, "unshare", "--uts", "sh", "-c", _AS_NODE, node.name, *drop,
                *map(str, argv)]

    def run(self, node: Node, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(node, argv), timeout=timeout, **kw)

    def popen(self, node: Node, argv: list[str], **kw) -> subprocess.Popen:
        """A process on `node`, in a session of its own; stopped (its group) by `stop` or at `down()`."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.argv(node, argv), **kw)
        self._procs.append(p)
        return p

    def stop(self, p: subprocess.Popen) -> None:
        self._stop(p)
        if p in self._procs:
            self._procs.remove(p)

    def stop_all(self) -> None:
        """Every process started on a node: ours (popen), then whatever else runs in a namespace of ours (a
        server a command detached) is ours too."""
        for p in list(self._procs):
            self.stop(p)
        for ns in self._made_ns:
            for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    @staticmethod
    def _stop(p: subprocess.Popen, grace: float = 5) -> None:
        if p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        except ProcessLookupError:
            p.wait(10)

    def listening(self, node: Node) -> list[tuple[str, int, str]]:
        """Every TCP socket listening in `node`'s namespace: (address, port, process name), from `ss -ltnpH`."""
        out = _sh("ip", "netns", "exec", node.ns, "ss", "-ltnpH").stdout
        socks = []
        for line in out.splitlines():
            f = line.split()
            if len(f) < 4:
                continue
            addr, _, port = f[3].rpartition(":")
            proc = f[5].split('"')[1] if len(f) > 5 and '"' in f[5] else "?"
            socks.append((addr.strip("[]").split("%")[0], int(port), proc))
        return socks

    def reachable(self, src: Node, targets: list[tuple[str, int]], timeout: float = 2) -> list[bool]:
        """For each (address, port): whether a TCP connection from `src` (as its user: uid 65534 on the outsider)
        opens within `timeout`; all probed at once, in one process on `src`."""
        if not targets:
            return []
        code = ("import socket,sys,threading\nt=float(sys.argv[1]);a=sys.argv[2:];r=['0']*(len(a)//2)\n"
                "def go(i):\n s=socket.socket();s.settimeout(t)\n try:\n  s.connect((a[2*i],int(a[2*i+1])));r[i]='1'\n"
                " except OSError:\n  pass\n finally:\n  s.close()\n"
                "th=[threading.Thread(target=go,args=(i,)) for i in range(len(r))]\n"
                "[x.start() for x in th];[x.join() for x in th];print(''.join(r))\n")
        flat = [str(x) for tgt in targets for x in tgt]
        p = self.run(src, ["/usr/bin/python3", "-c", code, str(timeout), *flat], timeout=timeout + 30)
        assert p.returncode == 0 and len(p.stdout.strip()) == len(targets), p.stderr
        return [c == "1" for c in p.stdout.strip()]

    def connects(self, src: Node, addr: str, port: int, timeout: float = 2) -> bool:
        return self.reachable(src, [(addr, port)], timeout)[0]

    def http_status(self, src: Node, url: str, headers: dict | None = None, post: str | None = None,
                    timeout: float = 10) -> int:
        """The HTTP status `src` gets for `url` (curl; 0 when no answer came)."""
        argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", str(timeout)]
        for k, v in (headers or {}).items():
            argv += ["-H", f"{k}: {v}"]
        if post is not None:
            argv += ["-H", "Content-Type: application/json", "--data", post]
        p = self.run(src, [*argv, url], timeout=timeout + 20)
        return int(p.stdout.strip() or 0)

    # -- faults -------------------------------------------------------------------------------------------------
    def link_down(self, node: Node) -> None:
        """The node's bridge port down: its link goes dark without a reset of any connection."""
        _sh("ip", "-n", self.bridge_ns, "link", "set", node.port, "down")
        self._faults.append(("link", node))

    def link_up(self, node: Node) -> None:
        _sh("ip", "-n", self.bridge_ns, "link", "set", node.port, "up")
        self._faults = [f for f in self._faults if f != ("link", node)]

    def narrow(self, node: Node, rate: str = "1mbit") -> None:
        """A token bucket of `rate` on the node's link, both ways."""
        for ns, dev in ((self.bridge_ns, node.port), (node.ns, "eth0")):
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit",
                "latency", "400ms")
        self._faults.append(("narrow", node))

    def loss(self, node: Node, percent: int) -> None:
        """nftables in the node's namespace drops `percent` % of what it receives on eth0."""
        match = "" if percent >= 100 else f"numgen random mod 100 < {int(percent)} "
        rules = (f"table inet lct_loss {{\n chain input {{\n  type filter hook input priority -10; policy accept;\n"
                 f'  iifname "eth0" {match}drop\n }}\n}}\n')
        self.nft(node, rules)
        self._faults.append(("loss", node))

    def fence(self, node: Node, rules: str) -> None:
        """Load a fence (an nftables rule set, e.g. llmcluster.launch.fence.render_nft's) on `node`."""
        self.nft(node, rules)
        self._faults.append(("fence", node))

    def nft(self, node: Node, rules: str) -> None:
        _sh("ip", "netns", "exec", node.ns, "nft", "-f", "-", input=rules)

    def heal(self) -> None:
        """Undo every fault: links up, no tbf, no nftables tables."""
        for kind, node in self._faults:
            if kind == "link":
                _sh("ip", "-n", self.bridge_ns, "link", "set", node.port, "up", check=False)
            elif kind == "narrow":
                _sh("tc", "-n", self.bridge_ns, "qdisc", "del", "dev", node.port, "root", check=False)
                _sh("tc", "-n", node.ns, "qdisc", "del", "dev", "eth0", "root", check=False)
            else:
                _sh("ip", "netns", "exec", node.ns, "nft", "flush", "ruleset", check=False)
        self._faults = []


def make_cluster(n_nodes: int = 3, **kw) -> NetCluster:
    """A NetCluster brought up, or the test's verdict when this machine cannot make one: a FAIL in CI or as root
    (a skipped cluster test would hide a broken fixture), a skip only for a developer who is not root."""
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    missing = [t for t in ("ip", "unshare", "setpriv", "ss", "nft", "tc") if shutil.which(t) is None]
    why = None
    if os.geteuid() != 0:
        why = "network namespaces need root"
    elif missing:
        why = f"missing {', '.join(missing)} (scripts/install_system_deps.sh installs them)"
    if why is None:
        try:
            return NetCluster(n_nodes, **kw).up()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            why = f"cannot make the namespace cluster: {e}"
    if ci or os.geteuid() == 0:
        pytest.fail(why)
    pytest.skip(why)


def wait_listening(cluster: NetCluster, node: Node, port: int, proc: subprocess.Popen | None = None,
                   timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p == port for _, p, _ in cluster.listening(node)):
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode} before listening on {port}")
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} on {node.name} after {timeout:.0f} s")
