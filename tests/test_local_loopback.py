"""A local run's listeners stay on 127.0.0.1 (issue 65): torchrun's agent runs through
llmcluster.distributed.loopback (its rendezvous store on a socket bound to loopback), every rank installs the
loopback TCPStore first thing (llmcluster/__main__.py: also a store made as torchft's Manager makes its own, with
the host name), and gloo's pairs take GLOO_SOCKET_IFNAME=lo. The inventory: every socket the run's processes listen
on, read with `ss` while rank 0 waits."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
RANK = """
import os, socket, subprocess, sys
from llmcluster.distributed.loopback import install
install()                                            # as llmcluster/__main__.py does, before torchft's import
import torch, torch.distributed as dist
from torch.distributed import TCPStore              # bound by name, as torchft's manager.py does
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)   # torchft's Manager's way
store.set("k", "v")
dist.barrier()
if dist.get_rank() == 0:
    agent = os.getppid()
    kids = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout.split()
    pids = {str(agent), *kids}
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [ln for ln in out.splitlines() if set(re.findall(r"pid=(\\d+)", ln)) & pids]
    open(sys.argv[1], "w").write("\\n".join(mine))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.skipif(shutil.which("ss") is None or shutil.which("pgrep") is None, reason="needs ss and pgrep")
def test_every_listener_of_a_local_run_is_on_loopback(tmp_path):
    from llmcluster.distributed import LOOPBACK_ENV

    script = tmp_path / "rank.py"
    script.write_text("import re\n" + RANK)
    out = tmp_path / "sockets.txt"
    # the argv LocalScheduler renders (spec.torchrun(..., loopback=True)) for a 2-rank run of `script`
    argv = [sys.executable, "-m", "llmcluster.distributed.loopback", "--local-addr", "127.0.0.1", "--standalone",
            "--nproc-per-node", "2", str(script), str(out)]
    env = {**os.environ, **LOOPBACK_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = out.read_text().splitlines()
    addrs = [ln.split()[3] for ln in lines]
    assert len(addrs) >= 4, lines          # the agent's store, the ranks' gloo pairs, the torchft-style store
    assert all(a.startswith("127.0.0.1:") for a in addrs), lines
    assert any("pt_elastic" in ln or "python" in ln for ln in lines)


def test_the_local_scheduler_renders_the_loopback_agent_and_environment(tmp_path):
    from test_launch import dry

    p = dry(tmp_path / "s", "--scheduler", "local")
    assert p.returncode == 0, p.stderr
    assert "export GLOO_SOCKET_IFNAME=lo" in p.stdout and "export LLMCLUSTER_LOOPBACK=1" in p.stdout
    assert re.search(r"-m llmcluster\.distributed\.loopback --local-addr 127\.0\.0\.1 --standalone", p.stdout), p.stdout


def _tree(pid: int) -> set[str]:
    """`pid` and its descendants, from /proc."""
    kids: dict[str, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(fields[1], []).append(stat.parent.name)
    out, todo = set(), [str(pid)]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += kids.get(p, [])
    return out


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss")
def test_a_local_ft_runs_listeners_are_all_on_loopback(tiny_root):
    """The issue's acceptance: `launch --scheduler local` of an ft run, 2 groups of 2 ranks (an agent per group,
    the ranks' stores, torchft's Manager stores and cross-group process groups, the Lighthouse, the heal servers):
    every socket its processes listen on, sampled while it runs, is on 127.0.0.1."""
    pytest.importorskip("torchft")
    from conftest import REPO, cli_env, overrides
    from test_launch_ft_local import FT

    argv = [sys.executable, "-m", "llmcluster", "launch", "-c", "llm_tiny", "--root", str(tiny_root), "--scheduler",
            "local", "--procs-per-node", "2", *overrides("run.name=ft-loopback", *FT, "parallel.dp_shard=-1")]
    proc = subprocess.Popen(argv, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, str] = {}
    while proc.poll() is None:
        pids = _tree(proc.pid)
        for ln in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False).stdout.splitlines():
            if set(re.findall(r"pid=(\d+)", ln)) & pids:
                seen[ln.split()[3]] = ln
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert len(seen) >= 6, seen            # the Lighthouse, 2 agents' stores, ranks' gloo and torchft listeners
    assert all(a.startswith("127.0.0.1:") for a in seen), [ln for a, ln in seen.items() if not a.startswith("127.")]
