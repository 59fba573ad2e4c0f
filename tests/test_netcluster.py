"""The cluster of network namespaces (tests/netcluster.py, issue 51) does what the cluster tests rely on: names
resolve as on a site, the outsider is unprivileged, each fault does what it says, and the fixture leaves nothing
of its own behind (and nothing of anyone else's removed)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import netcluster as nc

SERVE = ["/usr/bin/python3", "-m", "http.server", "--bind"]


def _http_server(cluster, node, port: int, directory=None):
    p = cluster.popen(node, [*SERVE, node.addr, str(port), *(["--directory", str(directory)] if directory else [])],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nc.wait_listening(cluster, node, port, p)
    return p


def test_nodes_resolve_each_other_by_short_name_and_fqdn_under_their_own_hostnames(netcluster):
    c = netcluster
    assert [n.name for n in c.nodes] == ["n0", "n1", "n2"] and c.head is c.nodes[0]
    assert len({n.addr for n in c.all_nodes}) == 4
    for node in c.all_nodes:
        assert c.run(node, ["hostname"]).stdout.strip() == node.name
        py = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"
        assert c.run(node, ["/usr/bin/python3", "-c", py]).stdout.split() == [node.name, node.addr]
    for name in ("n2", "n2.cluster.test"):
        assert c.run(c.nodes[1], ["getent", "hosts", name]).stdout.split()[0] == c.nodes[2].addr
    # the head reaches a peer by name, over the bridge
    _http_server(c, c.nodes[2], 8080)
    assert c.http_status(c.head, "http://n2.cluster.test:8080/") == 200


def test_the_outsider_is_unprivileged_and_cannot_read_a_private_file(netcluster, tmp_path):
    c = netcluster
    assert c.run(c.outsider, ["id", "-u"]).stdout.strip() == "65534"
    assert c.run(c.head, ["id", "-u"]).stdout.strip() == "0"
    secret = tmp_path / "api_key"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    p = c.run(c.outsider, ["cat", str(secret)])
    assert p.returncode != 0 and "s3cret" not in p.stdout
    # reaches the nodes (a fence, not the topology, is what keeps it out), never a route off the machine
    _http_server(c, c.head, 8081)
    assert c.connects(c.outsider, c.head.addr, 8081)
    routes = c.run(c.outsider, ["ip", "route"]).stdout
    assert "default" not in routes and str(c.subnet) in routes


def test_hosts_files_with_fqdns_only_leave_a_peers_short_name_unresolved():
    """short_names=False: the JobSet case, where a pod's peers resolve by FQDN (the headless Service) only."""
    c = nc.make_cluster(1, short_names=False)
    try:
        assert c.run(c.head, ["getent", "hosts", "out"]).returncode == 2
        assert c.run(c.head, ["getent", "hosts", c.outsider.fqdn]).stdout.split()[0] == c.outsider.addr
        assert c.run(c.head, ["getent", "hosts", "n0"]).stdout.split()[0] == c.head.addr     # its own, as ever
    finally:
        c.down()


def test_a_link_set_down_hangs_its_peers_without_a_reset(netcluster):
    c = netcluster
    _http_server(c, c.nodes[1], 8082)
    c.link_down(c.nodes[1])
    t0 = time.monotonic()
    assert not c.connects(c.head, c.nodes[1].addr, 8082, timeout=1.5)
    assert time.monotonic() - t0 >= 1.4, "refused at once: a reset, not a link gone dark"
    assert c.run(c.nodes[1], ["ip", "-o", "addr", "show", "eth0"]).stdout.count(c.nodes[1].addr) == 1  # still set
    c.link_up(c.nodes[1])
    assert c.connects(c.head, c.nodes[1].addr, 8082)


def test_loss_drops_what_the_node_receives_and_heal_lifts_it(netcluster):
    c = netcluster
    _http_server(c, c.nodes[2], 8083)
    c.loss(c.nodes[2], 100)
    assert not c.connects(c.head, c.nodes[2].addr, 8083, timeout=1)
    c.heal()
    assert c.connects(c.head, c.nodes[2].addr, 8083)
    c.loss(c.nodes[2], 20)      # some loss: TCP retransmits, the request still gets through
    assert c.http_status(c.head, f"http://{c.nodes[2].addr}:8083/") == 200


def test_a_narrow_link_slows_a_transfer_to_its_rate(netcluster, tmp_path):
    c = netcluster
    (tmp_path / "blob").write_bytes(os.urandom(512 * 1024))      # 4 Mbit: 2 s at 2 Mbit/s
    tmp_path.chmod(0o755)
    _http_server(c, c.nodes[1], 8084, directory=tmp_path)

    def fetch_s() -> float:
        p = c.run(c.head, ["curl", "-s", "-o", "/dev/null", "-w", "%{time_total}", "-m", "30",
                           "http://n1:8084/blob"])
        return float(p.stdout)
    fast = fetch_s()
    c.narrow(c.nodes[1], "2mbit")
    slow = fetch_s()
    assert slow > 1.5 and slow > 2 * fast, (fast, slow)


def test_names_and_subnets_differ_per_xdist_worker(monkeypatch):
    made = []
    for w in ("gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", w)
        made.append(nc.NetCluster(2))
    assert made[0].prefix != made[1].prefix and made[0].subnet != made[1].subnet
    assert made[0].prefix.startswith("lct1-") and made[1].subnet.is_private


def test_the_cluster_removes_exactly_what_it_made():
    """Only this process's names are compared: other workers and sessions make and remove clusters meanwhile. A
    namespace and /etc/netns dir of someone else's (a sentinel, named like a cluster's) must survive."""
    mine = f"lct{nc.worker_index()}-{os.getpid()}-"

    def world():
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        etc = {p.name for p in nc.NETNS_ETC.iterdir()} if nc.NETNS_ETC.exists() else set()
        return ({n for ln in names.splitlines() if ln.strip() and (n := ln.split()[0]).startswith(mine)},
                {n for n in etc if n.startswith(mine)})
    sentinel = f"{mine}sentinel"
    subprocess.run(["ip", "netns", "add", sentinel], check=True)
    (nc.NETNS_ETC / sentinel).mkdir(parents=True)
    try:
        before_ns, before_etc = world()
        c = nc.make_cluster(1)
        try:
            ns, etc = world()
            assert set(c.namespaces) == ns - before_ns and len(c.namespaces) == 3     # bridge, n0, outsider
            assert etc - before_etc == {c.head.ns, c.outsider.ns}
            c.popen(c.head, ["sleep", "600"])
        finally:
            c.down()
        assert world() == (before_ns, before_etc)          # ours gone, the sentinel (someone else's) kept
        assert sentinel in before_ns and sentinel in before_etc
    finally:
        subprocess.run(["ip", "netns", "delete", sentinel])
        (nc.NETNS_ETC / sentinel).rmdir()


@pytest.mark.parametrize("ci", ["", "true"])
def test_a_machine_that_cannot_make_namespaces_fails_in_ci_and_skips_a_developer(monkeypatch, ci):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match="need root"):
        nc.make_cluster(1)
