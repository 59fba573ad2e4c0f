"""`storage push` / `storage pull`: sealed checkpoint steps copied to a bucket (a directory here) marker last, and
the newest one brought back into a storage root: digests checked, a corrupt file refused in one line, an
interrupted pull resumed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from conftest import assert_one_line_error, run_cli

RUN = "cloudrun"


def sealed_step(root: Path, step: int, files: dict[str, bytes], marker: bool = True) -> Path:
    """A step as the checkpointer leaves it: its files, then COMPLETE.json with their sha256s."""
    d = root / "checkpoints" / RUN / f"step_{step}"
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    if marker:
        digests = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
        (d / "COMPLETE.json").write_text(json.dumps({"step": step, "files": digests,
                                                     "bytes": sum(map(len, files.values()))}))
    return d


def step_files(step: int) -> dict[str, bytes]:
    return {"model/.metadata": b"meta%d" % step, "train_state.json": json.dumps({"step": step}).encode(),
            "rng/rank_0.json": b"{}", "model/__0_0.distcp": os.urandom(300_000) + bytes([step])}


def test_push_copies_sealed_steps_only_marker_last_and_pull_brings_the_newest(tmp_path):
    node, bucket, fresh = tmp_path / "node", tmp_path / "bucket", tmp_path / "new-node"
    for s in (10, 20):
        sealed_step(node, s, step_files(s))
    sealed_step(node, 30, step_files(30), marker=False)            # being written: not sealed, never copied
    out = run_cli("storage", "push", RUN, "--to", bucket, "--root", node, check=True)
    assert "step_10, step_20" in out.stdout
    assert sorted(p.name for p in (bucket / RUN).iterdir()) == ["step_10", "step_20"]
    for s in (10, 20):
        for rel, data in step_files(s).items():
            if not rel.startswith("model/__"):
                assert (bucket / RUN / f"step_{s}" / rel).read_bytes() == data
    again = run_cli("storage", "push", RUN, "--to", bucket, "--root", node, check=True)
    assert "nothing new" in again.stdout

    out = run_cli("storage", "pull", RUN, "--from", bucket, "--root", fresh, check=True)
    assert "step_20: 4 file(s) copied" in out.stdout
    got = fresh / "checkpoints" / RUN / "step_20"
    assert (got / "COMPLETE.json").read_bytes() == (node / "checkpoints" / RUN / "step_20" / "COMPLETE.json").read_bytes()
    for rel in step_files(20):
        assert (got / rel).read_bytes() == (node / "checkpoints" / RUN / "step_20" / rel).read_bytes()
    assert not (fresh / "checkpoints" / RUN / "step_10").exists()      # the newest only
    assert "step_20 is already here" in run_cli("storage", "pull", RUN, "--from", bucket, "--root", fresh,
                                                check=True).stdout


def test_a_step_whose_push_was_interrupted_is_never_pulled(tmp_path):
    bucket = tmp_path / "bucket"
    sealed_step(tmp_path / "node", 10, step_files(10))
    run_cli("storage", "push", RUN, "--to", bucket, "--root", tmp_path / "node", check=True)
    half = bucket / RUN / "step_20"          # files there, marker not yet: the node was lost mid-push
    half.mkdir()
    (half / "train_state.json").write_text("{}")
    out = run_cli("storage", "pull", RUN, "--from", bucket, "--root", tmp_path / "fresh", check=True)
    assert "step_10" in out.stdout


def test_corrupt_file_refused_in_one_line_then_the_pull_resumes(tmp_path):
    bucket, fresh = tmp_path / "bucket", tmp_path / "fresh"
    sealed_step(tmp_path / "node", 10, step_files(10))
    run_cli("storage", "push", RUN, "--to", bucket, "--root", tmp_path / "node", check=True)
    shard = bucket / RUN / "step_10" / "model" / "__0_0.distcp"
    good = shard.read_bytes()
    shard.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))        # one flipped bit
    p = run_cli("storage", "pull", RUN, "--from", bucket, "--root", fresh)
    assert_one_line_error(p, "__0_0.distcp is corrupt")
    stage = fresh / "checkpoints" / RUN / ".pull-step_10"
    assert not (fresh / "checkpoints" / RUN / "step_10").exists()      # nothing the trainer would resume from
    assert not list(stage.rglob("*.distcp*"))                           # the bad copy is not kept
    assert (stage / "train_state.json").is_file()                      # the good ones before it are
    # the pull was interrupted there; a half-copied file of another run of it is left too
    (stage / "model").mkdir(exist_ok=True)
    (stage / "model" / ".metadata.part").write_bytes(b"me")
    shard.write_bytes(good)                                             # the bucket repaired
    out = run_cli("storage", "pull", RUN, "--from", bucket, "--root", fresh, check=True)
    assert "1 file(s) copied, 3 already here" in out.stdout    # the files before the shard: verified and kept
    got = fresh / "checkpoints" / RUN / "step_10"
    assert (got / "model" / "__0_0.distcp").read_bytes() == good and (got / "COMPLETE.json").is_file()
    assert not stage.exists() and not list(got.rglob("*.part"))


def test_a_marker_naming_files_outside_its_step_is_refused(tmp_path):
    bucket = tmp_path / "bucket"
    step = bucket / RUN / "step_5"
    step.mkdir(parents=True)
    (step / "COMPLETE.json").write_text(json.dumps({"step": 5, "files": {"../../../etc/passwd": "0" * 64}}))
    assert_one_line_error(run_cli("storage", "pull", RUN, "--from", bucket, "--root", tmp_path / "fresh"),
                          "not a file of the step")


def test_nothing_to_pull_from_an_empty_bucket(tmp_path):
    (tmp_path / "bucket").mkdir()
    out = run_cli("storage", "pull", RUN, "--from", tmp_path / "bucket", "--root", tmp_path / "fresh", check=True)
    assert "nothing to pull" in out.stdout


def test_a_link_in_the_bucket_is_refused(tmp_path):
    bucket = tmp_path / "bucket"
    sealed_step(tmp_path / "node", 10, step_files(10))
    run_cli("storage", "push", RUN, "--to", bucket, "--root", tmp_path / "node", check=True)
    state = bucket / RUN / "step_10" / "train_state.json"
    (tmp_path / "elsewhere.json").write_bytes(state.read_bytes())
    state.unlink()
    state.symlink_to(tmp_path / "elsewhere.json")
    assert_one_line_error(run_cli("storage", "pull", RUN, "--from", bucket, "--root", tmp_path / "fresh"),
                          "symbolic link")


def test_a_file_in_the_staging_folder_that_no_pull_wrote_is_never_deleted(tmp_path):
    """The staging folder lives in shared storage: a file there that is neither the step's nor a pull's half copy
    (.part) stops the pull in one line and stays where it is ("never delete what we did not write")."""
    import pytest as _pytest

    from llmcluster.errors import UserError
    from llmcluster.storage import bucket

    src = tmp_path / "bucket" / "r" / "step_2"
    src.mkdir(parents=True)
    (src / "w.bin").write_bytes(b"weights")
    import json

    from llmcluster.storage.layout import COMPLETE_MARKER, sha256_file
    (src / COMPLETE_MARKER).write_text(json.dumps({"step": 2, "files": {"w.bin": sha256_file(src / "w.bin")}}))
    root = tmp_path / "storage"
    stage = root / "checkpoints" / "r" / f"{bucket.PULL_PREFIX}step_2"
    stage.mkdir(parents=True)
    foreign = stage / "notes.txt"
    foreign.write_text("a colleague's")
    with _pytest.raises(UserError, match="not written by a pull"):
        bucket.pull(tmp_path / "bucket", "r", root)
    assert foreign.read_text() == "a colleague's"
