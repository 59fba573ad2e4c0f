from pathlib import Path

from conftest import assert_one_line_error, run_cli


def test_init_creates_layout_and_is_idempotent(tmp_path: Path):
    root = tmp_path / "s"
    run_cli("storage", "init", "--root", root, check=True)
    for d in ("datasets/code", "datasets/text", "datasets/multimodal", "checkpoints", "logs", "models", "scratch"):
        assert (root / d).is_dir(), d
    again = run_cli("storage", "init", "--root", root, check=True)
    assert "0 directories created" in again.stdout


def test_init_makes_the_shared_areas_sticky(tmp_path: Path):
    """Issue 65: only an entry's owner renames or removes it in checkpoints/, logs/, models/, scratch/ (a group
    member cannot put their own logs/<name> in place of another's); datasets/ is not shared that way. An existing
    root gets it too."""
    import stat

    root = tmp_path / "s"
    (root / "logs").mkdir(parents=True)
    (root / "logs").chmod(0o2775)
    run_cli("storage", "init", "--root", root, check=True)
    for d in ("checkpoints", "logs", "models", "scratch"):
        assert (root / d).stat().st_mode & stat.S_ISVTX, d
    assert (root / "logs").stat().st_mode & 0o7777 == 0o3775
    assert not (root / "datasets").stat().st_mode & stat.S_ISVTX


def test_root_from_env_then_config(tmp_path: Path):
    from conftest import cli_env
    env_root = tmp_path / "from_env"
    run_cli("storage", "init", env=cli_env(LLMCLUSTER_STORAGE=str(env_root)), check=True)
    assert (env_root / "checkpoints").is_dir()
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"run:\n  storage: {tmp_path / 'from_cfg'}\n")
    run_cli("storage", "init", "--config", cfg, check=True)
    assert (tmp_path / "from_cfg" / "logs").is_dir()


def test_every_command_finds_the_root_a_cluster_spec_names(tmp_path: Path):
    """A ./cluster.yaml (what `cluster init` writes; /storage on a Slurm head node) names the root: `storage init`,
    `launch` and `jobs` all use it. Before, launch wrote the job under the cluster's root while `jobs status` looked
    in ./storage: "no launched job named 'hello'"."""
    from conftest import cli_env
    shared = tmp_path / "shared"
    (tmp_path / "cluster.yaml").write_text(f"name: t\nstorage:\n  root: {shared}\n")
    run_cli("storage", "init", cwd=tmp_path, check=True)
    assert (shared / "logs").is_dir() and not (tmp_path / "storage").exists()
    run_cli("launch", "--scheduler", "local", "--set", "run.name=hello", "--", "bash", "-c", "echo hi",
            cwd=tmp_path, check=True)
    assert (shared / "logs" / "hello" / "job.json").is_file()
    status = run_cli("jobs", "status", "hello", cwd=tmp_path, check=True)
    assert "hello" in status.stdout
    # $LLMCLUSTER_STORAGE and --root still win over the spec, and a job config's run.storage too
    other = tmp_path / "other"
    run_cli("storage", "init", cwd=tmp_path, env=cli_env(LLMCLUSTER_STORAGE=str(other)), check=True)
    assert (other / "logs").is_dir()
    assert run_cli("jobs", "status", "hello", "--root", other, cwd=tmp_path).returncode == 2
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"run:\n  storage: {tmp_path / 'from_cfg'}\n")
    run_cli("storage", "init", "--config", cfg, cwd=tmp_path, check=True)
    assert (tmp_path / "from_cfg" / "logs").is_dir()
    from llmcluster.config.cluster_load import storage_root
    assert storage_root("x", "y") == Path("x").resolve() and storage_root(None, str(other)) == other


def test_status_lists_runs_and_latest_complete(tmp_path: Path):
    import json
    root = tmp_path / "s"
    run_cli("storage", "init", "--root", root, check=True)
    for step, complete in ((10, True), (20, True), (30, False)):
        d = root / "checkpoints" / "r1" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "x.bin").write_bytes(b"0" * 100)
        if complete:
            (d / "COMPLETE.json").write_text(json.dumps({"step": step}))
    out = run_cli("storage", "status", "--root", root, "--json", check=True)
    info = json.loads(out.stdout)
    assert info["runs"]["r1"]["latest_complete_step"] == 20
    assert info["runs"]["r1"]["incomplete"] == [30]
    assert info["areas"]["checkpoints"]["files"] == 5
    table = run_cli("storage", "status", "--root", root, check=True).stdout
    assert "r1" in table and "step_30" in table


def test_status_lists_serving_jobs_apart_from_runs(tmp_path: Path):
    """Issue 34: a `serve start` job has a logs/<name>/ folder (its job.json says kind serve) but no checkpoints:
    it is listed as a serving job, not as a run with 0 checkpoints."""
    import json
    root = tmp_path / "s"
    run_cli("storage", "init", "--root", root, check=True)
    (root / "checkpoints" / "r1" / "step_10").mkdir(parents=True)
    (root / "logs" / "serve-r1").mkdir(parents=True)
    (root / "logs" / "serve-r1" / "job.json").write_text(json.dumps(
        {"run": "serve-r1", "kind": "serve", "scheduler": "local", "job_id": "local-123", "state": "RUNNING",
         "endpoint": "http://127.0.0.1:8000/v1"}))
    info = json.loads(run_cli("storage", "status", "--root", root, "--json", check=True).stdout)
    assert list(info["runs"]) == ["r1"]
    assert info["serving"] == {"serve-r1": {"scheduler": "local", "job_id": "local-123", "state": "RUNNING",
                                            "endpoint": "http://127.0.0.1:8000/v1"}}
    table = run_cli("storage", "status", "--root", root, check=True).stdout
    assert "serving jobs" in table and table.index("serve-r1") > table.index("serving jobs")


def test_unwritable_root_is_one_line(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = run_cli("storage", "init", "--root", blocker / "sub")
    assert_one_line_error(proc, "cannot create")


def test_a_run_folder_holding_only_another_ranks_write_probe_is_this_launchs_to_remove(tmp_path: Path):
    """Rank 1 proves logs/<run> and checkpoints/<run> writable with a probe file it removes at once; rank 0 looking
    in that moment must still count the folder as made by this launch (a fresh-clone CI run once kept
    checkpoints/<run> of a refused two-rank launch). A folder holding anything else is not ours to remove."""
    from llmcluster.storage.layout import PROBE, Storage

    st = Storage(tmp_path)
    st.run_checkpoints("r").mkdir(parents=True)
    (st.run_checkpoints("r") / f"{PROBE}4242").write_bytes(b"")
    st.run_logs("r").mkdir(parents=True)
    (st.run_logs("r") / "notes.txt").write_text("a colleague's\n")
    fresh = st.require_run_dirs("r")
    assert fresh == [st.run_checkpoints("r")]
    (st.run_checkpoints("r") / f"{PROBE}4242").unlink()
    st.remove_if_empty(fresh)
    assert not st.run_checkpoints("r").exists() and (st.run_logs("r") / "notes.txt").exists()
