"""What an unlucky shared disk does to a run (issue 23), each reproduced through the CLI: a checkpoint share
that cannot be read (EIO), a corrupt newest step that retention used to count, and the run's owner lock under
the NFS flock rule, a contended probe, the create->flock window, a long startup and a dead owner elsewhere.
Single-process runs go through the CLI entry point in this process; lock contenders are real processes."""

from __future__ import annotations

import json
import re

import pytest

from faultkit import fresh_root, make_dataset, sets
from llmcluster.cli import main
from llmcluster.train.checkpoint import verify_checkpoint


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("shared") / "storage")


@pytest.fixture
def root(data_root, tmp_path):
    return fresh_root(data_root, tmp_path)


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def train(capsys, root, *extra, **over):
    return cli(capsys, "train", "-c", "llm_tiny", "--root", root, *sets(**over), *extra)


def ckpts(root, run="llm-tiny"):
    return root / "checkpoints" / run


def status(capsys, root) -> dict:
    code, out, _ = cli(capsys, "storage", "status", "--root", root, "--json")
    assert code == 0
    return json.loads(out)["runs"]["llm-tiny"]


# -- an unreadable share is that checkpoint's verdict ----------------------------------------------
@pytest.mark.parametrize("how", ["proc-mem", "hook"])
def test_io_error_while_hashing_a_share_falls_back_in_resume_and_export(capsys, root, monkeypatch, how):
    code, out, err = train(capsys, root, train__steps=8, checkpoint__interval_steps=4)
    assert code == 0, err
    shard = next((ckpts(root) / "step_8").glob("*.distcp"))
    if how == "proc-mem":  # a real EIO, for root too: reading /proc/self/mem at offset 0 (unmapped)
        shard.unlink()
        shard.symlink_to("/proc/self/mem")
    else:  # where the share is read for hashing (the real sha256 path runs for every other file)
        monkeypatch.setenv("LLMCLUSTER_TESTING", "1")
        monkeypatch.setenv("LLMCLUSTER_INJECT_READ_ERROR", f"step_8/{shard.name}")
    warning = rf"warning: skipping checkpoint \S*step_8: cannot read {shard.name}: Input/output error.* \(EIO\)"
    code, out, err = cli(capsys, "export", "--run", "llm-tiny", "--root", root)
    assert code == 0, err
    assert re.search(warning, err), err
    assert json.loads((root / "models/llm-tiny/config.json").read_text())["architectures"]
    code, out, err = train(capsys, root, train__steps=8, checkpoint__interval_steps=4)
    assert code == 0, err
    assert re.search(warning, out) and "step_4 (step 4)" in out, out
    # the unreadable step was set aside (not deleted: the error may be transient), then written again
    assert [p.name for p in ckpts(root).glob(".abandoned-*/step_8")] == ["step_8"]
    monkeypatch.delenv("LLMCLUSTER_INJECT_READ_ERROR", raising=False)
    assert verify_checkpoint(ckpts(root) / "step_8") is None


# -- retention counts verified checkpoints only ----------------------------------------------------
def test_a_step_skipped_by_resume_is_set_aside_not_counted_by_retention(capsys, root):
    code, out, err = train(capsys, root, train__steps=6, checkpoint__interval_steps=2, checkpoint__keep_last=2)
    assert code == 0, err
    assert sorted(p.name for p in ckpts(root).glob("step_*")) == ["step_4", "step_6"]
    shard = next((ckpts(root) / "step_6").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # resume falls back to step_4 and writes step_8; keep_last=2 used to keep the corrupt step_6 (its marker
    # exists) and delete the verified step_4
    code, out, err = train(capsys, root, train__steps=8, checkpoint__interval_steps=4, checkpoint__keep_last=2)
    assert code == 0, err
    assert "step_4 (step 4)" in out and "set aside step_6 (failed verification)" in out, out
    assert sorted(p.name for p in ckpts(root).glob("step_*")) == ["step_4", "step_8"]
    assert all(verify_checkpoint(ckpts(root) / f"step_{s}") is None for s in (4, 8))
    aside = list(ckpts(root).glob(".abandoned-*/step_6"))
    assert len(aside) == 1 and "does not match its checksum" in verify_checkpoint(aside[0])
    info = status(capsys, root)
    assert info["complete"] == 2 and info["latest_complete_step"] == 8 and not info["incomplete"]
    assert info["abandoned"] == [f"{aside[0].parent.name}/step_6"]
