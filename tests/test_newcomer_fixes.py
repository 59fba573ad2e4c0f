"""The smaller things a newcomer met (issue 53, item 9), one test each, through the CLI."""

from __future__ import annotations

import os
import stat

from conftest import assert_one_line_error, run_cli


def test_a_config_that_is_a_directory_is_named_as_one(tmp_path):
    assert_one_line_error(run_cli("train", "-c", tmp_path), "is a directory", "a .yaml")


def test_storage_status_of_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    assert_one_line_error(run_cli("storage", "status", "--root", tmp_path / "notes.md"), "is a file, not a directory")


def test_help_describes_serve_as_more_than_sizing():
    line = " ".join(run_cli("--help", check=True).stdout.split())
    assert "serve a model with vLLM" in line and "start it as a job" in line


def test_export_of_a_missing_step_lists_the_steps_there_are_and_every_file_gets_one_mode(fault_run8, tmp_path):
    """fault_run8: llm-tiny trained 8 steps, checkpoints at 4 and 8 (read only here: the export goes to --out)."""
    proc = run_cli("export", "--run", "llm-tiny", "--root", fault_run8, "--step", "7", "--out", tmp_path / "m")
    assert_one_line_error(proc, "step_7: no such checkpoint", "complete steps: 4, 8")
    old = os.umask(0o022)
    try:
        run_cli("export", "--run", "llm-tiny", "--root", fault_run8, "--out", tmp_path / "m", check=True)
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "m").iterdir() if f.is_file()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644, modes   # safetensors alone wrote 0600


def test_a_two_rank_run_says_its_precision_once_and_the_kernel_in_its_summary(tiny_root, tmp_path):
    """Issue 53, one line per fact: fp16 on a CPU without native fp16 computes in fp32 and says so once (not once
    per rank, nor again as a warning); the attention kernel follows the run's summary line."""
    import shutil

    import torch

    from conftest import overrides
    from llmcluster.distributed.process_groups import native_low_precision

    if native_low_precision(torch.device("cpu"), "fp16"):
        import pytest
        pytest.skip("this CPU runs fp16 natively: there is nothing to say")
    root = tmp_path / "storage"
    shutil.copytree(tiny_root, root, symlinks=True)
    proc = run_cli("train", "-c", "llm_tiny", "--root", root, "--procs-per-node", "2",
                   *overrides("run.name=once", "train.precision=fp16", "train.steps=1", "log.eval_interval=100"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert sum("fp16" in ln and "emulated" in ln for ln in lines) == 1, lines
    summary = next(i for i, ln in enumerate(lines) if ln.startswith("run once: "))
    assert lines[summary + 1].startswith("attention: SDPA ") and sum(ln.startswith("attention:") for ln in lines) == 1
