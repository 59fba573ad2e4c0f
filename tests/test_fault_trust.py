"""Runs and checkpoints you can trust (issue 12), each break reproduced through the CLI: planted code in a
checkpoint (with a re-sealed marker), export over a directory it did not write, checkpoints above the run's
own step, two writers of one run and a SIGKILLed owner, an I/O error on one rank, signals, a rebuilt dataset,
and test hooks without the testing switch. Single-process runs go through the CLI entry point in this
process (no 20 s torch import per run); concurrent writers and torchrun are real processes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch

from conftest import REPO
from faultkit import cli_cmd, copy_run, run, sets, torchrun_cmd, train_env, wait_for
from llmcluster.cli import main
from llmcluster.storage.layout import COMPLETE_MARKER, OWNER_LOCK
from llmcluster.checkpoint.checkpointer import verify_checkpoint


@pytest.fixture
def root(fault_root):
    return fault_root


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def train(capsys, root, *extra, **over):
    return cli(capsys, "train", "-c", "llm_tiny", "--root", root, *sets(**over), *extra)


def one_line(code, err, *needles) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def ckpts(root, run="llm-tiny"):
    return root / "checkpoints" / run


def reseal(step_dir):
    """What whoever can write the checkpoint can do: rewrite the marker to match the planted files."""
    marker = json.loads((step_dir / COMPLETE_MARKER).read_text())
    files = sorted(str(f.relative_to(step_dir)) for f in step_dir.rglob("*")
                   if f.is_file() and f.name != COMPLETE_MARKER)
    marker["files"] = {rel: hashlib.sha256((step_dir / rel).read_bytes()).hexdigest() for rel in files}
    (step_dir / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert verify_checkpoint  # the marker now matches: only the data-only rules stand in the way


def metadata_payload(flag) -> bytes:
    """A 100-byte protocol-4 pickle: `os.makedirs(flag)` reached through a dotted name of DCP's metadata
    module (which imports os)."""
    def s(x):
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b
    return (b"\x80\x04" + s("torch.distributed.checkpoint.metadata") + s("os.makedirs") + b"\x93"
            + s(str(flag)) + b"\x85R.")


class Payload:
    """Pickles to `os.makedirs(flag)`: what a planted non-tensor entry runs under weights_only=False."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __reduce__(self):
        return (os.makedirs, (self.flag,))


def plant_metadata(step_dir, flag):
    (step_dir / ".metadata").write_bytes(metadata_payload(flag))


def plant_entry(step_dir, flag):
    """Rewrite the DCP files with the optimizer's lr replaced by a payload; train state and RNG kept."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step_dir, step_dir.parent / "plain.pt")
    state = torch.load(step_dir.parent / "plain.pt", weights_only=False)
    (step_dir.parent / "plain.pt").unlink()
    state["optim"]["param_groups"][0]["lr"] = Payload(flag)
    for f in [*step_dir.glob("*.distcp"), step_dir / ".metadata"]:
        f.unlink()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(step_dir), no_dist=True)


@pytest.mark.parametrize("plant", [plant_metadata, plant_entry], ids=["metadata", "non-tensor-entry"])
def test_planted_code_with_a_resealed_marker_never_runs(capsys, root, fault_run8, tmp_path, plant):
    # the payloads are live: the stock unpicklers would run them
    probe = tmp_path / "probe"
    pickle.loads(metadata_payload(probe) if plant is plant_metadata else pickle.dumps(Payload(probe)))
    assert probe.is_dir()

    copy_run(fault_run8, root)     # trained 8 steps, checkpoints 4 and 8
    flag = tmp_path / "pwned"
    step8 = ckpts(root) / "step_8"
    plant(step8, flag)
    reseal(step8)

    # export --step 8 and --resume PATH name it and refuse it, in one line
    code, out, err = cli(capsys, "export", "--run", "llm-tiny", "--root", root, "--step", 8)
    one_line(code, err, "cannot export", "step_8", "refused")
    code, out, err = train(capsys, root, "--resume", step8, train__steps=8, checkpoint__interval_steps=4)
    one_line(code, err, f"--resume {step8}", "refused")
    # export and --resume auto skip it with a warning and take step_4
    code, out, err = cli(capsys, "export", "--run", "llm-tiny", "--root", root)
    assert code == 0, err
    assert re.search(r"warning: skipping checkpoint .*step_8: refused: ", err), err
    assert json.loads((root / "models" / "llm-tiny" / "llmcluster.json").read_text())["step"] == 4
    code, out, err = train(capsys, root, train__steps=8, checkpoint__interval_steps=4)
    assert code == 0, err
    assert re.search(r"warning: skipping checkpoint .*step_8: refused: ", out), out
    assert "step_4 (step 4)" in out
    assert not flag.exists()
    # the planted step_8 was moved aside (not deleted) when step_8 was written again
    assert list(ckpts(root).glob(".abandoned-*/step_8")) and verify_checkpoint(step8) is None


def test_marker_entries_must_stay_inside_the_step_and_list_metadata_and_state(capsys, root):
    code, out, err = train(capsys, root, train__steps=4, checkpoint__interval_steps=4)
    assert code == 0, err
    step = ckpts(root) / "step_4"
    good = json.loads((step / COMPLETE_MARKER).read_text())
    for rel in ("../../outside", "/etc/passwd"):
        (step / COMPLETE_MARKER).write_text(json.dumps({**good, "files": {**good["files"], rel: "0" * 64}}))
        assert "not a file inside the step" in verify_checkpoint(step)
    files = {k: v for k, v in good["files"].items() if k != "train_state.json"}
    (step / COMPLETE_MARKER).write_text(json.dumps({**good, "files": files}))
    assert "does not list train_state.json" in verify_checkpoint(step)
    code, out, err = train(capsys, root, "--resume", step, train__steps=4)
    one_line(code, err, "does not list train_state.json")


# -- export ---------------------------------------------------------------------------------------
def test_export_never_deletes_what_it_did_not_write(capsys, root, tmp_path, monkeypatch):
    code, out, err = train(capsys, root, train__steps=4, checkpoint__interval_steps=4)
    assert code == 0, err
    export = ("export", "--run", "llm-tiny", "--root", root, "--out")
    foreign = tmp_path / "thesis"
    foreign.mkdir()
    (foreign / "chapter1.tex").write_text("years of work")
    one_line(*cli(capsys, *export, foreign)[::2], "not empty and not an earlier llmcluster export")
    assert (foreign / "chapter1.tex").read_text() == "years of work"

    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    one_line(*cli(capsys, *export, ".")[::2], "refusing to replace")
    assert (work / "notes.txt").read_text() == "keep"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    for target in (tmp_path / "home", "/", root, root / "checkpoints", root / "models", tmp_path):
        one_line(*cli(capsys, *export, target)[::2], "refusing to replace")
    assert (work / "notes.txt").is_file() and (foreign / "chapter1.tex").is_file()

    # a fresh directory, then an earlier export of ours: replaced (swapped), no temporary left behind
    out_dir = tmp_path / "hf"
    assert cli(capsys, *export, out_dir)[0] == 0
    (out_dir / "model.safetensors").write_bytes(b"stale")
    assert cli(capsys, *export, out_dir)[0] == 0
    assert (out_dir / "model.safetensors").stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")) == []
    assert json.loads((out_dir / "llmcluster.json").read_text())["step"] == 4


# -- retention and roll-back --------------------------------------------------------------------
def test_reused_run_name_with_resume_never_is_refused(capsys, root, fault_run8):
    copy_run(fault_run8, root)     # trained 8 steps, checkpoints 4 and 8
    code, out, err = train(capsys, root, "--resume", "never", train__steps=8, checkpoint__interval_steps=4,
                           checkpoint__keep_last=2)
    one_line(code, err, "run llm-tiny already has checkpoints up to step 8: choose another run.name or "
                        "--resume auto")
    assert verify_checkpoint(ckpts(root) / "step_8") is None and verify_checkpoint(ckpts(root) / "step_4") is None


def test_roll_back_sets_higher_checkpoints_aside_and_keeps_the_one_just_written(capsys, root):
    code, out, err = train(capsys, root, train__steps=16, checkpoint__interval_steps=4, checkpoint__keep_last=5)
    assert code == 0, err
    # roll back to step_4; with keep_last=2 retention on main counted step_12 and step_16 and deleted the
    # step_8 it had just written
    code, out, err = train(capsys, root, "--resume", ckpts(root) / "step_4", train__steps=16,
                           checkpoint__interval_steps=4, checkpoint__keep_last=2, train__stop_at=8)
    assert code == 0, err
    m = re.search(r"rolled back to step 4: moved step_8, step_12, step_16 to (\S+)", out)
    assert m, out
    aside = m.group(1)
    assert all(verify_checkpoint(ckpts(root) / aside.split("/")[-1] / f"step_{s}") is None for s in (8, 12, 16))
    assert verify_checkpoint(ckpts(root) / "step_8") is None and not (ckpts(root) / "step_16").exists()
    # the requeue (--resume auto) continues the new trajectory from step_8, not the abandoned step_16
    code, out, err = train(capsys, root, train__steps=16, checkpoint__interval_steps=4, checkpoint__keep_last=2)
    assert code == 0 and "step_8 (step 8)" in out, out
    assert verify_checkpoint(ckpts(root) / "step_16") is None


def test_retention_counts_only_steps_up_to_the_one_written(tmp_path):
    from llmcluster.storage.layout import Storage
    from llmcluster.checkpoint.checkpointer import Checkpointer

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = Checkpointer(Storage(tmp_path), "r", 0, 1, keep_last=2, log=lambda *_: None)
    ck.save(50, model, opt, {})            # a higher step of another trajectory
    for step in (10, 20, 30):
        ck.save(step, model, opt, {})
        assert verify_checkpoint(ck.dir / f"step_{step}") is None
    assert sorted(int(d.name[5:]) for d in ck.dir.glob("step_*")) == [20, 30, 50]
    sealed = (ck.dir / "step_20" / "COMPLETE.json").read_bytes()
    assert ck.save(20, model, opt, {}) is None   # a committed step is final: the rewrite is discarded (issue 62)
    assert (ck.dir / "step_20" / "COMPLETE.json").read_bytes() == sealed and not list(ck.dir.glob(".abandoned-*"))


# -- one writer ---------------------------------------------------------------------------------
def test_second_writer_is_refused_and_a_killed_owner_is_taken_over(capsys, root, tmp_path):
    over = dict(train__steps=3000, checkpoint__interval_steps=10, checkpoint__keep_last=2)
    a = subprocess.Popen(cli_cmd("train", "-c", "llm_tiny", "--root", root, *sets(**over)), cwd=REPO,
                         env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lock = ckpts(root) / OWNER_LOCK
        assert wait_for(lambda: (ckpts(root) / "step_10" / COMPLETE_MARKER).is_file(), 120, a), a.poll()
        holder = json.loads(lock.read_text())
        assert holder["pid"] == a.pid and holder["host"] and holder["start"]
        # a second writer, 2 ranks: every rank refuses in the same one line, A is untouched
        proc = run(torchrun_cmd(2, "train", "-c", "llm_tiny", "--root", root, *sets(**over), monitor_interval=3),
                   timeout=180)       # every rank's line is read (faultkit.torchrun_cmd)
        assert proc.returncode != 0
        lines = re.findall(r"llmcluster train: error: (.*)", proc.stderr)
        assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
        assert f"run llm-tiny already has a writer: pid {a.pid} on" in lines[0]
        assert a.poll() is None and json.loads(lock.read_text()) == holder
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
    # a SIGKILLed owner leaves its lock (and maybe a half-written step): `storage status` lists both
    leftover = ckpts(root) / ".tmp-step_999-deadbeef"
    leftover.mkdir(exist_ok=True)
    status = json.loads(subprocess.run(cli_cmd("storage", "status", "--root", root, "--json"), cwd=REPO,
                                       env=train_env(), capture_output=True, text=True, check=True).stdout)
    info = status["runs"]["llm-tiny"]
    assert info["owner"]["pid"] == a.pid and ".tmp-step_999-deadbeef" in info["leftovers"]
    latest = max(int(d.name[5:]) for d in ckpts(root).glob("step_*") if (d / COMPLETE_MARKER).is_file())
    code, out, err = train(capsys, root, **{**over, "train__stop_at": latest + 2})
    assert code == 0, err
    assert f"taking over the owner lock from pid {a.pid} on" in out and "is not running on this host" in out
    assert "removed .tmp-step_999-deadbeef" in out and not leftover.exists()
    assert f"step_{latest} (step {latest})" in out and not lock.exists()


def test_stale_heartbeat_from_another_host_is_taken_over(capsys, root):
    # a lock from another host: alive while its heartbeat moves, stale once it has not moved for
    # checkpoint.lock_stale_s (two reads of the server's mtime, never compared with this host's clock)
    d = ckpts(root)
    d.mkdir(parents=True)
    (d / OWNER_LOCK).write_text(json.dumps({"run": "llm-tiny", "host": "elsewhere", "pid": 1, "start": "x",
                                            "attempt": "old"}))
    past = time.time() + 3600   # a clock an hour ahead over there: it must not matter either way
    os.utime(d / OWNER_LOCK, (past, past))
    stop = threading.Event()

    def beat():  # the owner elsewhere, alive
        while not stop.wait(0.05):
            os.utime(d / OWNER_LOCK)
    t = threading.Thread(target=beat)
    t.start()
    try:
        code, out, err = train(capsys, root, train__steps=4, checkpoint__lock_stale_s=2)
    finally:
        stop.set()
        t.join()
    one_line(code, err, "run llm-tiny already has a writer: pid 1 on elsewhere")
    code, out, err = train(capsys, root, train__steps=4, checkpoint__lock_stale_s=0.5)
    assert code == 0, err
    assert "watching its heartbeat for 0.5 s" in out
    assert re.search(r"taking over the owner lock from pid 1 on elsewhere since x: its heartbeat did not change "
                     r"in [\d.]+ s \(checkpoint.lock_stale_s=0.5\)", out), out


def test_a_writer_whose_lock_was_taken_over_stops_without_writing(root):
    """A node cut off long enough for its lock to go stale, then back: the new owner (here: a record
    swapped in, as a take-over from another host leaves it) wins; the old writer stops at its next
    heartbeat and seals nothing more."""
    over = dict(train__steps=3000, checkpoint__interval_steps=10)
    a = subprocess.Popen(cli_cmd("train", "-c", "llm_tiny", "--root", root, *sets(**over)), cwd=REPO,
                         env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (ckpts(root) / "step_10" / COMPLETE_MARKER).is_file(), 120, a), a.poll()
        new = ckpts(root) / "new-owner"
        new.write_text(json.dumps({"run": "llm-tiny", "host": "elsewhere", "pid": 1, "start": "x", "attempt": "n"}))
        os.replace(new, ckpts(root) / OWNER_LOCK)
        out, err = a.communicate(timeout=120)
    finally:
        a.kill()
    assert a.returncode == 2, (out[-2000:], err[-2000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "lost the owner lock" in lines[0] and "stopping without writing" in lines[0]
    assert json.loads((ckpts(root) / OWNER_LOCK).read_text())["host"] == "elsewhere"   # not removed by A


# -- agreement on failure, parallel verification ------------------------------------------------
def test_io_error_on_one_rank_ends_every_rank_with_the_same_line(root):
    common = ("train", "-c", "llm_tiny", "--root", root)
    over = dict(train__steps=8, checkpoint__interval_steps=4, dist__timeout_s=300)
    proc = run(torchrun_cmd(2, *common, *sets(**over)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # rank 1 hashes its own shard on resume: its corruption is found and named
    shard = ckpts(root) / "step_8" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])
    # every rank's line is read: torchrun looks every 3 s (faultkit.torchrun_cmd says why)
    proc = run(torchrun_cmd(2, *common, *sets(**over), monitor_interval=3), timeout=300, LLMCLUSTER_TESTING="1",
               LLMCLUSTER_INJECT_IO_ERROR="1:8")
    assert "warning: skipping checkpoint" in proc.stdout and "__1_0.distcp does not match its checksum" in proc.stdout
    lines = re.findall(r"llmcluster train: error: (.*)", proc.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]
    assert "cannot write checkpoint step_8" in lines[0] and "Input/output error" in lines[0]
    assert "dist.timeout_s" not in proc.stderr
    assert not list(ckpts(root).glob(".tmp-*")) and verify_checkpoint(ckpts(root) / "step_4") is None


# -- signals, dataset identity, test hooks -------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["ctrl-c", "sighup"])
def test_ctrl_c_and_sighup_checkpoint_like_sigterm(capsys, root, sig):
    from test_fault_preempt import signal_self_after

    metrics = root / "logs" / "llm-tiny" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    watcher = signal_self_after(metrics, 5, sig)
    code, out, err = train(capsys, root, train__steps=3000, checkpoint__interval_steps=1000)
    watcher.join()
    assert code == 75, (out, err)
    m = re.search(r"preempted at step (\d+): checkpoint written", out)
    assert m and verify_checkpoint(ckpts(root) / f"step_{m.group(1)}") is None


def test_second_ctrl_c_aborts_without_a_checkpoint(capsys, root):
    from llmcluster.train.signals import PreemptionFlag

    flag = PreemptionFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.set
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        flag.uninstall()


def test_resume_over_a_rebuilt_dataset_is_refused_unless_allowed(capsys, root, fault_data, tmp_path):
    ds = root / "datasets" / "code"
    ds.unlink()
    shutil.copytree(fault_data / "datasets" / "code", ds)
    code, out, err = train(capsys, root, train__steps=4, checkpoint__interval_steps=2)
    assert code == 0, err
    # rebuilt from edited sources of the same size: same number of windows, other tokens
    src = tmp_path / "other"
    shutil.copytree(fault_data.parent / "src", src)
    for f in src.iterdir():
        f.write_text(f.read_text().replace("x", "y"))
    shutil.rmtree(ds / "t")
    code, out, err = cli(capsys, "data", "prepare", "--root", root, "--name", "t", "--source", src,
                         "--tokenizer", "byte", "--val-fraction", "0")
    assert code == 0, err
    code, out, err = train(capsys, root, train__steps=6, checkpoint__interval_steps=2)
    one_line(code, err, "dataset t changed since", "checkpoint.allow_dataset_change=true")
    code, out, err = train(capsys, root, train__steps=6, checkpoint__interval_steps=2,
                           checkpoint__allow_dataset_change=True)
    assert code == 0 and "step_4 (step 4)" in out, err


def test_fault_injection_needs_the_testing_switch(capsys, root, monkeypatch):
    monkeypatch.delenv("LLMCLUSTER_TESTING", raising=False)
    monkeypatch.setenv("LLMCLUSTER_INJECT_NAN_AT_STEP", "2")
    import llmcluster.testing as testing
    monkeypatch.setattr(testing, "_said", set())
    code, out, err = train(capsys, root, train__steps=3, checkpoint__interval_steps=100)
    assert code == 0 and "non-finite" not in out
    assert "warning: LLMCLUSTER_INJECT_NAN_AT_STEP is set but ignored" in err
    monkeypatch.setenv("LLMCLUSTER_TESTING", "1")
    code, out, err = train(capsys, root, train__steps=3, checkpoint__interval_steps=100, run__name="t2")
    assert code == 0 and "step 2: non-finite loss" in out
    assert "WARNING: test hook LLMCLUSTER_INJECT_NAN_AT_STEP=2 is active" in err
