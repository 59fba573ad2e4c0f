"""What a new user following the README met: each break found by trying it from a fresh clone, through the CLI.

The README's own examples run in tests/test_readme.py; these are the bugs behind them, one test each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, assert_one_line_error, cli_env, run_cli


@pytest.mark.parametrize("argv, shipped", [
    (["plan", "plans/seed-a100-7b.yaml"], "`seed-a100-7b`"),
    (["train", "--config", "configs/llm_tiny.yaml"], "`llm_tiny`"),
    (["cluster", "show", "--cluster", "clusters/seed-a100.yaml"], "`seed-a100`"),
])
def test_checkout_path_outside_the_checkout_names_the_shipped_item(tmp_path, argv, shipped):
    # The README's paths are relative to the checkout; elsewhere the error says so and names what to type.
    proc = run_cli(*argv, cwd=tmp_path)
    assert_one_line_error(proc, "file not found", "the shipped", shipped, str(tmp_path))


def test_missing_path_of_no_shipped_stem_lists_the_shipped_ones(tmp_path):
    proc = run_cli("plan", "plans/nope.yaml", cwd=tmp_path)
    assert_one_line_error(proc, "plan file not found: plans/nope.yaml", "nor a shipped plan", "seed-a100-7b")


def test_storage_status_of_a_missing_root_is_one_line_exit_2(tmp_path):
    proc = run_cli("storage", "status", "--root", tmp_path / "nonexistent")
    assert_one_line_error(proc, "does not exist", "storage init")
    assert proc.stdout == ""


@pytest.mark.parametrize("value", ["-1", "nan", "-inf", "hot"])
def test_generate_refuses_a_temperature_that_is_not_a_non_negative_number(tmp_path, value):
    # before: -1 sampled greedily, as if 0 had been asked for. Refused before any model is looked for.
    proc = run_cli("generate", "--model", "missing-run", "--root", tmp_path, "--temperature", value)
    assert_one_line_error(proc, "--temperature")


def test_refused_run_leaves_no_run_folders(tmp_path):
    root = tmp_path / "st"
    run_cli("storage", "init", "--root", root, check=True)
    proc = run_cli("train", "-c", "llm_tiny", "--root", root)   # no dataset prepared: refused
    assert_one_line_error(proc, "dataset")
    assert not (root / "checkpoints" / "llm-tiny").exists()
    assert not (root / "logs" / "llm-tiny").exists()
    status = json.loads(run_cli("storage", "status", "--root", root, "--json", check=True).stdout)
    assert status["runs"] == {}


def test_the_write_probe_outlives_a_peer_removing_the_empty_folder(tmp_path, monkeypatch):
    # Ranks of one refused run raced: one removed the empty logs/<run> while another was between its mkdir and
    # its probe (or about to open events.jsonl): a traceback, exit 1, instead of the one-line refusal. Now only
    # rank 0 removes (train/trainer.py), and the probe makes the folder again once.
    from pathlib import Path

    from llmcluster.storage.layout import Storage

    layout, target = Storage(tmp_path), tmp_path / "logs" / "r"
    real, calls = Path.write_bytes, []

    def vanish_once(self, data):
        calls.append(self)
        if len(calls) == 1:
            self.parent.rmdir()          # a peer's cleanup, between our mkdir and our probe
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", vanish_once)
    assert layout.require_writable(target) == target and target.is_dir() and len(calls) == 2
    assert list(target.iterdir()) == []          # the probe is gone again


def test_refused_run_keeps_folders_it_did_not_create(tmp_path):
    root = tmp_path / "st"
    run_cli("storage", "init", "--root", root, check=True)
    mine = root / "logs" / "llm-tiny"
    mine.mkdir()
    assert_one_line_error(run_cli("train", "-c", "llm_tiny", "--root", root), "dataset")
    assert mine.is_dir()


def test_storage_status_does_not_list_bench_records_as_a_run(tmp_path):
    root = tmp_path / "st"
    run_cli("storage", "init", "--root", root, check=True)
    (root / "logs" / "bench").mkdir()
    (root / "logs" / "bench" / "llm-tiny-20261202-210729-w2.json").write_text("{}")
    (root / "logs" / "myrun").mkdir()
    status = json.loads(run_cli("storage", "status", "--root", root, "--json", check=True).stdout)
    assert sorted(status["runs"]) == ["myrun"]
    assert "bench" not in run_cli("storage", "status", "--root", root, check=True).stdout.split("runs")[-1]


def test_demo_script_exports_and_samples_the_run_it_trained(tmp_path):
    # README: `scripts/demo.sh --set train.precision=fp32 --set run.name=llm-tiny-fp32` after a bf16 demo. The
    # script used to export and sample llm-tiny whatever run it trained. Its llmcluster is a stand-in
    # that record their arguments (training is tested elsewhere); its python is the real one.
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    shim = venv / "bin" / "llmcluster"
    shim.write_text(f'#!/bin/sh\necho "llmcluster $*" >> {log}\n')
    shim.chmod(0o755)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    env = cli_env(VENV=str(venv), LLMCLUSTER_STORAGE=str(tmp_path / "st"), PYTHONPATH=str(REPO))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "demo.sh"), "--set", "train.precision=fp32",
                           "--set", "run.name=llm-tiny-fp32"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert any(c.startswith("llmcluster train --procs-per-node 2 ") and "run.name=llm-tiny-fp32" in c
               for c in calls), calls
    assert any(c.startswith("llmcluster export --run llm-tiny-fp32 ") for c in calls), calls
    assert any(c.startswith("llmcluster generate --model llm-tiny-fp32 ") for c in calls), calls
    assert "precision" not in proc.stderr   # the trainer says it, once (issue 53)


def test_emit_config_starts_from_the_preset_and_changes_only_what_the_plan_decides(tmp_path):
    from llmcluster.config.load import load_job_config

    out = tmp_path / "job.yaml"
    proc = run_cli("plan", "seed-a100-7b", "--emit-config", out, cwd=tmp_path, check=True)
    assert f"wrote {out}" in proc.stdout
    job, preset = load_job_config(str(out)), load_job_config("llm_7b")
    # the preset's own choices survive (before: data, steps, lr, compile and checkpoints were dropped, the run renamed)
    for section in ("run", "model", "data", "checkpoint", "log"):
        assert getattr(job, section) == getattr(preset, section), section
    for key in ("steps", "lr", "warmup_steps", "compile", "precision"):
        assert getattr(job.train, key) == getattr(preset.train, key), key
    # what the plan decides: its layout (the search table's --set line) and the job's size
    best = json.loads(run_cli("plan", "seed-a100-7b", "--search", "--json", cwd=tmp_path, check=True).stdout)
    for item in best["search"][0]["set"]:
        key, value = item.split("=", 1)
        section, name = key.split(".")
        assert str(getattr(getattr(job, section), name)).lower() == value.lower(), item
    assert (job.job.nodes, job.job.gpus_per_node) == (4, 4)


def test_commands_that_write_files_say_where(tmp_path):
    out = tmp_path / "prometheus.yml"
    proc = run_cli("monitor", "config", "--cluster", "seed-a100", "-o", out, check=True)
    assert proc.stdout.strip() == f"wrote {out}: Prometheus scrape config for 8 node(s)" and out.is_file()
    proc = run_cli("validate", "stack", "--report", tmp_path / "r.json", cwd=tmp_path)
    assert proc.returncode in (0, 1) and f"report: {tmp_path / 'r.json'}" in proc.stdout.splitlines()
    assert json.loads((tmp_path / "r.json").read_text())
    proc = run_cli("plan", "seed-a100-7b", "--plot", tmp_path / "plots", check=True)
    assert f"wrote {tmp_path / 'plots' / 'memory.png'}, {tmp_path / 'plots' / 'cost.png'}" in proc.stdout


def test_tables_are_whole_when_piped(tmp_path):
    # rich assumes 80 columns when stdout is not a terminal: 7 columns were squeezed into cut, wrapped headers
    root = tmp_path / "st"
    run_cli("storage", "init", "--root", root, check=True)
    (root / "checkpoints" / "a-run-with-a-rather-long-descriptive-name-2026").mkdir()
    out = run_cli("storage", "status", "--root", root, check=True, env=cli_env(COLUMNS="")).stdout
    header = next(ln for ln in out.splitlines() if "checkpoints" in ln and "exported" in ln)
    for col in ("run", "latest complete step", "incomplete", "writer", "leftovers", "exported"):
        assert col in header, header
    assert "a-run-with-a-rather-long-descriptive-name-2026" in out
    assert "\x1b[" not in out   # no colour codes in a pipe


def test_a_dataset_without_validation_tokens_says_so(tmp_path):
    # before: a 6-byte file prepared "successfully" with 0 val tokens and no word about it, and training
    # then had no validation loss. Still made (it trains), but with a warning naming the cause.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n")
    # --val-fraction 0: the split hashes the document's path, so at 0.05 one file in 20 tmp paths lands in val
    proc = run_cli("data", "prepare", "--root", tmp_path / "storage", "--name", "tiny", "--source", src,
                   "--tokenizer", "bpe:300", "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr
    assert "0 val tokens" in proc.stdout
    assert "warning: tiny has no validation tokens" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
