"""Helpers for the fault-tolerance tests: a tiny byte-level dataset, the tiny fp32 config, torchrun, and
reading a checkpoint's tensors back in one process for bitwise comparisons."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from conftest import REPO, cli_env, run_cli

# A 0.1M-parameter Llama in fp32 on one thread per rank: ~30 ms a step on these 2 shared cores.
TINY = {
    "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.ffn_hidden": 128, "model.vocab_size": 257, "data.seq_len": 32, "data.dataset": "t",
    "train.micro_batch": 2, "train.precision": "fp32", "train.threads": 1, "train.warmup_steps": 2,
    "log.interval": 5, "log.eval_interval": 1000, "log.eval_batches": 1, "log.progress": False,
}


def sets(**over) -> list[str]:
    """--set arguments for TINY plus overrides given as section__key=value."""
    cfg = {**TINY, **{k.replace("__", "."): v for k, v in over.items()}}
    out = []
    for k, v in cfg.items():
        out += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return out


def make_dataset(root: Path) -> Path:
    """A ~130k-token byte-level dataset `t` under root, from generated Python-like source files."""
    src = root.parent / "src"
    src.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for i in range(20):
        lines = [f"def f{j}(x):\n    return x * {rng.randint(0, 99)} + {j}\n" for j in range(200)]
        (src / f"m{i}.py").write_text("".join(lines))
    run_cli("data", "prepare", "--root", root, "--name", "t", "--source", src, "--tokenizer", "byte",
            "--val-fraction", "0", check=True)
    return root


def fresh_root(data_root: Path, tmp_path: Path) -> Path:
    """A fresh storage root that shares data_root's dataset (symlinked): one test's runs, one dataset."""
    r = tmp_path / "storage"
    (r / "datasets").mkdir(parents=True)
    (r / "datasets" / "code").symlink_to(data_root / "datasets" / "code")
    return r


def copy_run(src_root: Path, root: Path, run: str = "llm-tiny") -> None:
    """A trained run (conftest's fault_run8) into `root`, a fresh_root: its checkpoints and records, as if it had
    trained there (they name no path of their root); the original stays as the next test needs it."""
    for area in ("checkpoints", "logs"):
        shutil.copytree(src_root / area / run, root / area / run, symlinks=True)


def slowed(tmp_path: Path, sleep: str, **hooks: str) -> tuple[dict, Path]:
    """The environment of a run whose steps are slowed (LLMCLUSTER_INJECT_SLEEP: the run outlasts what the test
    waits for or probes), and the file that ends the slowing once the test has seen it: the rest of the run goes at
    full speed."""
    go = tmp_path / "go"
    return cli_env(LLMCLUSTER_TESTING="1", LLMCLUSTER_INJECT_SLEEP=sleep, LLMCLUSTER_INJECT_SLEEP_UNTIL=str(go),
                   **hooks), go


def train_env(**extra: str) -> dict:
    env = cli_env(**extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "5"   # survivors of a killed rank are stopped quickly
    return env


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0, monitor_interval: float = 0.2) -> list[str]:
    """`monitor_interval`: how soon torchrun notices a rank's exit and SIGTERMs the others. Tests that read every
    rank's last line give it seconds: on a loaded 2-core runner 0.2 s came before a peer had printed."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", f"--monitor-interval={monitor_interval}", "-m", "llmcluster",
            *map(str, args)]


def run(cmd: list[str], timeout: float = 240, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=train_env(**env), capture_output=True, text=True, timeout=timeout)


def cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmcluster", *map(str, args)]


def model_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint, read in this one process (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    state = torch.load(out, weights_only=False)
    out.unlink()
    return state["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    ta, tb = model_tensors(a), model_tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs between {a} and {b}"


def wait_for(pred, timeout: float, proc: subprocess.Popen | None = None, poll: float = 0.01):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(poll)
    return None


class StandInProc:
    """A group's process as the ft supervisor's loop sees it (pid, returncode, poll), for unit tests of that loop."""

    def __init__(self, pid: int, rc: int | None):
        self.pid, self.returncode = pid, rc

    def poll(self) -> int | None:
        return self.returncode


def stand_in_supervisor(tmp_path: Path, procs: list, monkeypatch, last_step: int = 10):
    """The ft supervisor (launch/ft_local.py) over stood-in groups (StandInProc): its loop's state set as __init__
    sets it, no process started or signalled, job.json not written; its events go to tmp_path/events.jsonl."""
    from types import SimpleNamespace

    from llmcluster.launch import ft_local

    n = len(procs)
    sup = ft_local.Supervisor.__new__(ft_local.Supervisor)
    sup.groups, sup.logs, sup.procs, sup.trees = n, tmp_path, procs, [[p.pid] for p in procs]
    sup.restarts, sup.waited, sup.dropped, sup.done = [0] * n, [0] * n, [0] * n, [False] * n
    sup.failed_at = [[] for _ in range(n)]
    sup.restart_at, sup.stopping, sup.lighthouse, sup.end_seen = {}, None, None, None
    sup.ckpt_dir = tmp_path / "checkpoints"
    sup.cfg = SimpleNamespace(train=SimpleNamespace(last_step=last_step), ft=SimpleNamespace(end_grace_s=30.0),
                              run=SimpleNamespace(name="stand-in"))
    monkeypatch.setattr(sup, "_signal_group", lambda g, sig: None)
    monkeypatch.setattr(sup, "_look", lambda force=False: False)
    monkeypatch.setattr(sup, "_record", lambda state, code=None: None)
    monkeypatch.setattr(ft_local, "POLL_S", 0)
    return sup


# llm_tiny shrunk further (2 layers, d_model 64) so ranks on shared CPU cores step fast, on the `src` dataset of
# conftest.repo_source_dataset (byte tokenizer: 256 bytes + EOS = vocab 257): as `--set` arguments
TINY_SRC_ARGS = ["--config", "llm_tiny", "--set", "data.dataset=src", "--set", "model.vocab_size=257",
                 "--set", "model.n_layers=2", "--set", "model.d_model=64", "--set", "model.n_heads=4",
                 "--set", "model.n_kv_heads=2", "--set", "model.ffn_hidden=128",
                 "--set", "data.seq_len=32", "--set", "train.micro_batch=2", "--set", "train.precision=fp32",
                 "--set", "train.warmup_steps=2", "--set", "log.interval=1", "--set", "log.eval_interval=1000"]

