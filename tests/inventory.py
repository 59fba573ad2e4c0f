"""docs/security.md's "Listening sockets" table, read as the test's checklist (issue 51): which row names each
socket a job listens on, and what the outsider must (not) get from it."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from conftest import REPO

CLASSES = ("authenticated", "loopback", "fenced by the site")
KINDS = ("train", "train ft", "lighthouse", "serve", "monitor")


@dataclass(frozen=True)
class Row:
    kind: str
    socket: str
    port: str            # `rdzv`, a flag (--port, log.metrics_bind), or `ephemeral`
    bind: str            # `*`, `127.0.0.1`, `node`, or the flag that sets it
    cls: str


def rows(text: str | None = None) -> list[Row]:
    """The table under "## Listening sockets" (backticks and emphasis stripped)."""
    text = text if text is not None else (REPO / "docs" / "security.md").read_text()
    section = text.split("## Listening sockets", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [re.sub(r"[`*]", "", c).strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "job kind":
            continue
        assert len(cells) == 5, f"a row of the inventory has {len(cells)} cells, not 5: {line}"
        out.append(Row(*cells))
    return out


def _bind_ok(row: Row, addr: str, node_addr: str) -> bool:
    if row.bind == "*":
        return addr in ("*", "0.0.0.0", "::")
    if row.bind == "node":
        return addr == node_addr
    if row.bind.startswith(("1", ":")):        # a literal address
        return addr == row.bind
    return True                                # a flag sets it: whatever the test gave it


def _port_ok(row: Row, port: int, named: dict[str, int]) -> bool:
    if row.port == "ephemeral":
        return port not in named.values()
    return named.get(row.port) == port


def match(table: list[Row], kind: str, sockets: list[tuple[str, int, str]], named: dict[str, int],
          node_addr: str) -> tuple[list[tuple[tuple, Row]], list[str]]:
    """Each listening socket (address, port, process) of a job of `kind` on a node at `node_addr` with the row
    that names it; and a line for every socket no row names. `named`: the port each named port token has in
    this run (`{"rdzv": 29400}`); a flag-bound row names its port the same way (`{"--port": 9400}`)."""
    mine = [r for r in table if r.kind == kind]
    found, problems = [], []
    for sock in sockets:
        addr, port, proc = sock
        hits = [r for r in mine if _port_ok(r, port, named) and _bind_ok(r, addr, node_addr)]
        if hits:
            found.append((sock, hits[0]))
        else:
            problems.append(f"{kind}: {proc} listens on {addr}:{port}, which docs/security.md's inventory "
                            "does not name")
    return found, problems


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def outsider_problems(cluster, node, found: list[tuple[tuple, Row]]) -> list[str]:
    """Probe each socket from the outsider (uid 65534, no key) by its class: a loopback or fenced one must not
    accept a connection at the node's address; an authenticated one must refuse an unauthenticated request."""
    problems = []
    reach = cluster.reachable(cluster.outsider, [(node.addr, s[1]) for s, _ in found])
    for ((addr, port, proc), row), ok in zip(found, reach):
        where = f"{row.kind} {row.socket!r} ({proc} on {addr}:{port})"
        if row.cls == "loopback":
            if not is_loopback(addr):
                problems.append(f"{where}: a loopback row bound to {addr}")
            if ok:
                problems.append(f"{where}: the outsider connects to {node.addr}:{port}")
        elif row.cls == "fenced by the site":
            if ok:
                problems.append(f"{where}: the outsider connects to {node.addr}:{port} (is the fence on?)")
        elif row.cls == "authenticated":
            code = cluster.http_status(cluster.outsider, f"http://{node.addr}:{port}/v1/completions", post="{}")
            if code not in (401, 403):
                problems.append(f"{where}: an unauthenticated POST from the outsider got {code}")
        else:
            problems.append(f"{where}: class {row.cls!r} is none of {CLASSES}")
    return problems


def fence(cluster, job_nodes, open_ports=()) -> None:
    """The site's fence (llmcluster.launch.fence) on each of the job's nodes, its peers the job's nodes."""
    from llmcluster.launch.fence import render_nft

    rules = render_nft([n.addr for n in job_nodes], list(open_ports))
    for node in job_nodes:
        cluster.fence(node, rules)


def check(cluster, node, kind: str, named: dict[str, int]) -> list[str]:
    """The inventory's verdict on `node` while a job of `kind` runs there: a line for each socket the table does
    not name, then for each of the outsider's probes (by class) that got what it must not."""
    found, problems = match(rows(), kind, cluster.listening(node), named, node.addr)
    return problems + outsider_problems(cluster, node, found)
