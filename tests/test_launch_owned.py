"""A run's files are the caller's own (issue 50): a logs/<run>/ or checkpoints/<run>/ someone else made first is
refused in one line, a planted temp-file link redirects no write, and a queued Slurm job trains only on the config
its launch recorded. The tests run as root: "someone else" is uid 65534 (os.chown)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import assert_one_line_error, cli_env, run_cli
from test_launch import run_batch_script

OTHER = 65534   # nobody


def planted(logs: Path, victim: Path) -> None:
    """logs/<run>/ made by someone else first, with `.job.json.tmp` a link to the victim's own file."""
    logs.mkdir(parents=True)
    victim.write_text("the victim's notes\n")
    (logs / ".job.json.tmp").symlink_to(victim)
    os.chown(logs, OTHER, OTHER)


@pytest.mark.parametrize("area", ["logs", "checkpoints"])
def test_a_run_folder_someone_else_owns_is_refused_and_nothing_written(tmp_path, area):
    root, victim = tmp_path / "s", tmp_path / "notes.txt"
    run_cli("storage", "init", "--root", root, check=True)
    if area == "logs":
        planted(root / "logs" / "mine", victim)
    else:
        (root / "checkpoints" / "mine").mkdir()
        os.chown(root / "checkpoints" / "mine", OTHER, OTHER)
    p = run_cli("launch", "--scheduler", "local", "--root", root, "--set", "run.name=mine", "--", "true")
    assert_one_line_error(p, f"{root / area / 'mine'}", "owned by uid 65534")
    assert not (root / "logs" / "mine" / "launches").exists() and not (root / "logs" / "mine" / "job.json").exists()
    if area == "logs":
        assert victim.read_text() == "the victim's notes\n"


def test_the_records_temp_file_is_never_written_through_a_planted_link(tmp_path):
    from llmcluster.storage.job_record import read_record, write_record

    logs, victim = tmp_path / "logs" / "run", tmp_path / "notes.txt"
    logs.mkdir(parents=True)
    victim.write_text("the victim's notes\n")
    (logs / ".job.json.tmp").symlink_to(victim)
    write_record(logs, {"run": "run", "scheduler": "local", "state": "RUNNING"})
    assert victim.read_text() == "the victim's notes\n"
    assert not (logs / "job.json").is_symlink() and read_record(logs, own=True)["state"] == "RUNNING"
    assert sorted(p.name for p in logs.iterdir()) == [".job.json.tmp", "job.json"]   # no temp file left


def test_a_record_someone_else_wrote_is_not_acted_on(tmp_path, capsys):
    from llmcluster.storage.job_record import read_record

    logs = tmp_path / "logs" / "run"
    logs.mkdir(parents=True)
    (logs / "job.json").write_text(json.dumps({"run": "run", "scheduler": "local", "pid": 12345}))
    os.chown(logs / "job.json", OTHER, OTHER)
    assert read_record(logs)["pid"] == 12345            # a reader's view (jobs list) still sees it
    assert read_record(logs, own=True) is None          # what jobs status|cancel act on: not this one
    assert "owned by uid 65534" in capsys.readouterr().err
    (logs / "job.json").unlink()
    (logs / "job.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"run": "run", "scheduler": "local"}))
    assert read_record(logs) is None and "a symbolic link" in capsys.readouterr().err


def test_jobs_cancel_leaves_a_process_named_by_someone_elses_record_alone(tmp_path, capsys):
    import subprocess
    import sys

    from conftest import cli_inprocess

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        logs = tmp_path / "s" / "logs" / "r"
        logs.mkdir(parents=True)
        (logs / "job.json").write_text(json.dumps({"run": "r", "scheduler": "local", "state": "RUNNING",
                                                    "job_id": f"local-{victim.pid}", "pid": victim.pid}))
        os.chown(logs / "job.json", OTHER, OTHER)
        for verb in ("cancel", "status"):
            p = cli_inprocess(capsys, "jobs", verb, "r", "--root", tmp_path / "s")
            assert_one_line_error(p, str(logs / "job.json"), "owned by uid 65534")
        assert victim.poll() is None, "the process someone else's record named was signalled"
    finally:
        victim.kill()
        victim.wait()


def test_the_trainer_refuses_a_checkpoint_folder_someone_else_owns(tmp_path):
    from llmcluster.errors import UserError
    from llmcluster.storage.layout import Storage

    st = Storage(tmp_path)
    st.run_checkpoints("r").mkdir(parents=True)
    os.chown(st.run_checkpoints("r"), OTHER, OTHER)
    with pytest.raises(UserError, match="owned by uid 65534"):
        st.require_run_dirs("r")
    assert not st.run_logs("r").exists()                 # refused before anything was made


def test_the_ranks_refuse_a_launch_config_that_is_a_link_or_someone_elses(tmp_path, capsys):
    from conftest import cli_inprocess

    launch = tmp_path / "s" / "logs" / "r" / "launches" / "1"
    launch.mkdir(parents=True)
    config = launch / "config.yaml"
    config.write_text("run: {name: r}\n")
    os.chown(config, OTHER, OTHER)
    p = cli_inprocess(capsys, "train", "--config", config, "--root", tmp_path / "s")
    assert_one_line_error(p, f"launch config {config}", "owned by uid 65534")
    config.unlink()
    config.symlink_to(tmp_path / "elsewhere.yaml")
    (tmp_path / "elsewhere.yaml").write_text("run: {name: r}\n")
    assert_one_line_error(cli_inprocess(capsys, "train", "--config", config, "--root", tmp_path / "s"), "a symbolic link")


FAKE_SBATCH = "#!/bin/bash\necho 4242\n"


def test_a_swapped_launch_config_is_refused_before_training(tmp_path):
    root, bin_dir = tmp_path / "s", tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    env = cli_env(PATH=f"{bin_dir}:{os.environ['PATH']}")
    run_cli("launch", "--scheduler", "slurm", "--root", root, "--nodes", "2", env=env, check=True)
    launch = root / "logs" / "llm-tiny" / "launches" / "1"
    script, config = (launch / "job.sbatch").read_text(), launch / "config.yaml"
    rec = json.loads((root / "logs" / "llm-tiny" / "job.json").read_text())
    import hashlib
    assert rec["config_sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()

    out, _ = run_batch_script(tmp_path, script)              # as launched: it trains
    assert (tmp_path / "fake.log.argv").is_file() and "refusing" not in out, out
    (tmp_path / "fake.log.argv").unlink()

    swapped = config.read_text().replace("steps:", "steps: 1\n#", 1)
    config.unlink()
    config.write_text(swapped)
    out, _ = run_batch_script(tmp_path, script)
    lines = [ln for ln in out.splitlines() if "refusing" in ln]
    assert len(lines) == 1 and str(config) in lines[0] and "changed or replaced" in lines[0], out
    assert not (tmp_path / "fake.log.argv").exists(), "srun ran: the swapped config was trained on"
