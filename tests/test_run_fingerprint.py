"""A run and its config that disagree are refused in one line (issue 53): the run fingerprint saved with every
checkpoint, checked before any weight is loaded (and in the CLI process, before ranks or torch start); a config
that names no run; a `--resume PATH` of another run, refused unless --init-from-checkpoint says what it does."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import assert_one_line_error, overrides, run_cli
from llmcluster.checkpoint.fingerprint import check_fingerprint
from llmcluster.errors import UserError

STEPS = ("train.steps=2", "checkpoint.interval_steps=2", "log.eval_interval=100")


def _train(root: Path, run: str, *items: str, args: tuple[str, ...] = ()):
    return run_cli("train", "-c", "llm_tiny", "--root", root, *args, *overrides(*STEPS, f"run.name={run}", *items))


@pytest.fixture(scope="module")
def fp_root(tiny_root: Path, tmp_path_factory) -> Path:
    """A storage root with the session's tiny dataset and run `fp` trained 2 steps (one checkpoint)."""
    root = tmp_path_factory.mktemp("fp") / "storage"
    shutil.copytree(tiny_root, root, symlinks=True)
    proc = _train(root, "fp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((root / "checkpoints/fp/step_2/train_state.json").read_text())["fingerprint"]["d_model"] == 64
    return root


@pytest.mark.parametrize("change, named", [
    ("model.d_model=32", "model.d_model 64 -> 32"),
    ("model.n_layers=3", "model.n_layers 2 -> 3"),
    ("model.vocab_size=300", "model.vocab_size 257 -> 300"),
])
def test_a_shape_change_under_an_existing_run_is_one_line(fp_root, change, named):
    assert_one_line_error(_train(fp_root, "fp", change), "run fp", "checkpoint", named, "another run.name")


def test_a_shape_change_on_two_ranks_is_one_line_before_any_rank_starts(fp_root):
    proc = _train(fp_root, "fp", "model.ffn_hidden=96", args=("--procs-per-node", "2"))
    assert_one_line_error(proc, "model.ffn_hidden 128 -> 96")
    assert "[rank" not in proc.stdout + proc.stderr


def _rewrite_state(step: Path, change) -> None:
    """Edit a checkpoint's train_state.json and reseal its COMPLETE.json (as a checkpoint of that content)."""
    state = json.loads((step / "train_state.json").read_text())
    change(state)
    (step / "train_state.json").write_text(json.dumps(state))
    marker = json.loads((step / "COMPLETE.json").read_text())
    marker["files"]["train_state.json"] = hashlib.sha256((step / "train_state.json").read_bytes()).hexdigest()
    (step / "COMPLETE.json").write_text(json.dumps(marker))


def test_what_only_the_trainer_sees_is_one_line_on_two_ranks(fp_root):
    """The tokenizer's digest needs the dataset (the CLI's check reads the config alone): the trainer's check, on
    every rank before any weight is loaded, still ends in one line and exit 2."""
    shutil.copytree(fp_root / "checkpoints" / "fp", fp_root / "checkpoints" / "tok")
    _rewrite_state(fp_root / "checkpoints" / "tok" / "step_2",
                   lambda s: s["fingerprint"].update(tokenizer="0123456789abcdef"))
    proc = _train(fp_root, "tok", "train.steps=3", args=("--procs-per-node", "2"))
    assert_one_line_error(proc, "tokenizer.json sha256 0123456789abcdef -> ")
    assert "[rank" not in proc.stdout + proc.stderr and "attention:" not in proc.stdout   # no summary of a refused run
    assert sorted(p.name for p in (fp_root / "checkpoints" / "tok").iterdir() if p.name.startswith("step")) == ["step_2"]


def test_the_trainer_compares_every_field_but_the_layout():
    saved = {"fingerprint": {"d_model": 64, "tokenizer": "ab", "pipeline_stages": 2, "base_precision": "bf16"}}
    with pytest.raises(UserError, match=r"tokenizer.json sha256 ab -> cd; base_precision bf16 -> fp32"):
        check_fingerprint(Path("step_2"), saved, {"d_model": 64, "tokenizer": "cd", "pipeline_stages": 2,
                                                  "base_precision": "fp32"}, "r")
    assert "pipeline stages 2 -> 1" in check_fingerprint(Path("step_2"), saved, {"d_model": 64, "tokenizer": "ab",
                                                                                 "pipeline_stages": 1}, "r")
    assert check_fingerprint(Path("step_2"), {}, {"d_model": 32}, "r") is None   # written before fingerprints


def test_a_checkpoint_without_a_fingerprint_still_resumes(fp_root):
    old = fp_root / "checkpoints" / "old"
    shutil.copytree(fp_root / "checkpoints" / "fp", old)
    _rewrite_state(old / "step_2", lambda s: s.pop("fingerprint"))
    # another shape is refused all the same: the saved config (in every train state) gives the model's
    assert_one_line_error(_train(fp_root, "old", "train.steps=3", "model.ffn_hidden=96"),
                          "model.ffn_hidden 128 -> 96")
    proc = _train(fp_root, "old", "train.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "(step 2)" in proc.stdout


def test_an_empty_config_or_one_naming_no_run_is_refused(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert_one_line_error(run_cli("train", "-c", tmp_path / "empty.yaml", "--root", tmp_path / "s"),
                          "empty.yaml is empty", "run.name")
    (tmp_path / "noname.yaml").write_text("train: {steps: 3}\n")
    assert_one_line_error(run_cli("train", "-c", tmp_path / "noname.yaml", "--root", tmp_path / "s"),
                          "noname.yaml names no run", "--set run.name=NAME")
    assert not (tmp_path / "s").exists()


def test_resume_never_over_checkpoints_is_refused_before_torch(fp_root):
    assert_one_line_error(_train(fp_root, "fp", args=("--resume", "never")), "run fp already has checkpoints up to step 2")


def test_a_foreign_resume_is_refused_and_moves_nothing_then_starts_with_the_flag(fp_root):
    assert _train(fp_root, "mine", "train.steps=4").returncode == 0
    mine = fp_root / "checkpoints" / "mine"
    before = sorted(p.name for p in mine.iterdir())
    foreign = fp_root / "checkpoints" / "fp" / "step_2"
    proc = _train(fp_root, "mine", "train.steps=4", args=("--resume", str(foreign)))
    assert_one_line_error(proc, "not a checkpoint of run mine", "--init-from-checkpoint")
    assert sorted(p.name for p in mine.iterdir()) == before
    run_cli("export", "--run", "mine", "--root", fp_root, check=True)   # of step_4, which the start sets aside
    proc = _train(fp_root, "mine", "train.steps=3", args=("--resume", str(foreign), "--init-from-checkpoint"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting from another run's checkpoint" in proc.stdout and "finished step 3" in proc.stdout
    assert "is the export of step_4, set aside with them" in proc.stdout, proc.stdout
    assert (mine / "step_3" / "COMPLETE.json").is_file()
