"""Every listening socket in one inventory (issue 51): docs/security.md's "Listening sockets" table, checked on the
cluster of network namespaces (tests/netcluster.py). Each job kind runs on its nodes; every TCP socket its
namespace listens on must be a row of the table, and the outsider (no node of the job, uid 65534, no key) is
probed against each by the row's class. The fenced rows run behind the fence we document for Slurm sites
(llmcluster.launch.fence's nftables rules): the job still works, the outsider is cut off."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import inventory as inv
import netcluster as nc
from conftest import REPO, cli_env
from llmcluster.config.schema import FtConfig
from llmcluster.errors import UserError
from llmcluster.launch.fence import main as fence_main, render_nft
from llmcluster.launch.spec import lighthouse_argv

TABLE = inv.rows()
RDZV = 29400
LIGHTHOUSE_BIN = str(Path(sys.executable).parent / "torchft_lighthouse")


# -- the table itself ---------------------------------------------------------------------------------------------

def test_the_inventory_names_every_job_kind_with_one_of_three_classes():
    assert {r.kind for r in TABLE} == set(inv.KINDS)
    assert {r.cls for r in TABLE} <= set(inv.CLASSES), {r.cls for r in TABLE}
    # the torchft sockets llmcluster binds to the group's own address (issue 49): the node's, not every address
    ft = {r.socket.split(" (")[0].split(",")[0]: r for r in TABLE if r.kind == "train ft"}
    assert [r.bind for r in TABLE if r.kind == "train ft" and ("ManagerServer" in r.socket or "heal" in r.socket)] \
        == ["node", "node"], ft
    assert [r.cls for r in TABLE if r.kind == "serve"] == ["authenticated", "loopback"]
    # the fence the fenced rows rely on is named where the table is
    section = (REPO / "docs" / "security.md").read_text().split("## Listening sockets", 1)[1].split("\n## ")[0]
    assert "python -m llmcluster.launch.fence" in section


def test_the_fence_renders_one_table_of_its_own_and_refuses_what_is_no_address(capsys):
    text = render_nft(["10.1.2.3", "10.9.0.0/16", "fd00::1"], [8000])
    assert text.startswith("table inet llmcluster_fence {")
    assert "ip saddr { 10.1.2.3/32, 10.9.0.0/16 } accept" in text and "ip6 saddr { fd00::1/128 } accept" in text
    assert "tcp dport { 8000 } accept" in text and "tcp dport 1024-65535 ct state new drop" in text
    with pytest.raises(UserError, match="peer 'n1'"):
        render_nft(["n1"])
    with pytest.raises(UserError, match="no peers"):
        render_nft([])
    assert fence_main(["--peers", "10.0.0.1", "--ports", "9-8"]) == 2
    assert "expected 1 <= N <= M" in capsys.readouterr().err


# -- each job kind on the namespace cluster -----------------------------------------------------------------------

def _torchrun(cluster, node, root: Path, steps: int, log: Path, env: dict) -> subprocess.Popen:
    from faultkit import sets

    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"n0.cluster.test:{RDZV}", "--rdzv-id", "inv",
            "-m", "llmcluster", "train", "-c", "llm_tiny", "--root", str(root),
            *sets(train__steps=steps, checkpoint__interval_steps=1000), "--set", "run.name=ns-train"]
    return cluster.popen(node, argv, env=env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_for_ranks(cluster, nodes, procs, timeout: float = 120) -> None:
    """Until every node's rank listens on its own address (gloo's pairs: the job is past its set-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(any(a == n.addr for a, _, _ in cluster.listening(n)) for n in nodes):
            return
        assert all(p.poll() is None for p in procs), "a node's torchrun exited before its rank was up"
        time.sleep(0.3)
    raise AssertionError("the ranks' gloo sockets never showed")


@pytest.mark.slow
def test_a_two_node_run_trains_behind_the_fence_and_names_every_socket(netcluster, fault_data, tmp_path):
    from faultkit import fresh_root, slowed

    c = netcluster
    job = c.nodes[:2]
    root = fresh_root(fault_data, tmp_path)
    inv.fence(c, job)                       # before the start: the run comes up behind it
    logs = [tmp_path / f"{n.name}.log" for n in job]
    # rank 0 sleeps 0.5 s before each step until the sockets are probed: however fast the machine steps, the run
    # is still training then (a 200-step run once ended before the probes did), and goes fast after
    env, go = slowed(tmp_path, "0:0.5")
    procs = [_torchrun(c, n, root, 200, log, env) for n, log in zip(job, logs)]
    _wait_for_ranks(c, job, procs)
    problems = []
    for node in job:
        problems += inv.check(c, node, "train", {"rdzv": RDZV})
    still_training = all(p.poll() is None for p in procs)
    go.touch()
    rcs = [p.wait(240) for p in procs]
    assert problems == [], problems
    assert rcs == [0, 0], [log.read_text()[-2000:] for log in logs]
    assert still_training, "the run ended before the probes: the sockets were not checked while it trained"
    assert "finished step 200" in logs[0].read_text()


def _exporter(cluster, node, port: int, *bind: str) -> subprocess.Popen:
    p = cluster.popen(node, [sys.executable, "-m", "llmcluster", "monitor", "serve", "--port", str(port), *bind],
                      env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nc.wait_listening(cluster, node, port, p)
    return p


def test_the_exporter_on_loopback_and_bound_to_the_node_behind_the_fence(netcluster):
    c = netcluster
    _exporter(c, c.head, 9400)
    assert inv.check(c, c.head, "monitor", {"--port": 9400}) == []
    assert c.http_status(c.head, "http://127.0.0.1:9400/metrics") == 200
    c.stop_all()
    # bound to the node for a Prometheus elsewhere: fenced; a job node scrapes it, the outsider is cut off
    inv.fence(c, c.nodes)
    _exporter(c, c.head, 9401, "--bind", c.head.addr)
    assert inv.check(c, c.head, "monitor", {"--port": 9401}) == []
    assert c.http_status(c.nodes[2], "http://n0:9401/metrics") == 200


def _lighthouse(cluster, node) -> subprocess.Popen:
    argv = lighthouse_argv(LIGHTHOUSE_BIN, FtConfig(min_replicas=1, join_timeout_s=0.1), f"{node.addr}:29510")
    p = cluster.popen(node, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    nc.wait_listening(cluster, node, 29510, p)
    return p


def test_the_lighthouse_on_the_head_node_answers_the_groups_and_not_the_outsider(netcluster):
    c = netcluster
    inv.fence(c, c.nodes)
    _lighthouse(c, c.head)
    assert inv.check(c, c.head, "lighthouse", {"--bind": 29510}) == []
    assert c.http_status(c.nodes[1], "http://n0.cluster.test:29510/") == 200       # a group's node


# -- the inventory test can fail ------------------------------------------------------------------------------------

def test_one_listening_socket_more_fails_the_inventory(netcluster):
    c = netcluster
    _exporter(c, c.head, 9400)
    extra = ("import socket,time\ns=socket.socket();s.bind(('0.0.0.0',4444));s.listen();time.sleep(600)")
    p = c.popen(c.head, ["/usr/bin/python3", "-c", extra])
    nc.wait_listening(c, c.head, 4444, p)
    problems = inv.check(c, c.head, "monitor", {"--port": 9400})
    assert len(problems) == 1 and "0.0.0.0:4444" in problems[0] and "does not name" in problems[0], problems


def test_a_fenced_port_the_outsider_reaches_without_the_fence_fails_the_inventory(netcluster):
    c = netcluster
    _lighthouse(c, c.head)                  # no fence loaded
    problems = inv.check(c, c.head, "lighthouse", {"--bind": 29510})
    assert len(problems) == 1 and "the outsider connects" in problems[0] and ":29510" in problems[0], problems
