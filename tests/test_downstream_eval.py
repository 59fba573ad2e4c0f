"""The `eval:` section (issue 28): a downstream evaluation job per new checkpoint, and retention that never
deletes a checkpoint whose evaluation is pending.

The evaluation job itself is `llmcluster eval` (lm-evaluation-harness in its own venv, tested with it);
here a sleeping stand-in process takes its place (its command line carries `eval` and the step, as the
real one's does), so that "pending" is a real live process and "ended" a real exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_one_line_error, run_cli
from llmcluster.config import load_job_config
from llmcluster.storage.layout import Storage
from llmcluster.train import downstream
from llmcluster.checkpoint.checkpointer import Checkpointer
from llmcluster.train.downstream import Downstream, pending_steps


def stand_in(argv: list[str], seconds: float = 60) -> list[str]:
    """A process that looks like the evaluation of argv's step (its arguments kept), alive for `seconds`."""
    return [sys.executable, "-c", f"import time; time.sleep({seconds})", *argv[3:]]


def cfg(*sets: str):
    return load_job_config(None, ["run.name=r", *sets])


def test_submits_every_nth_checkpoint_and_the_last(tmp_path, monkeypatch):
    real = downstream.eval_argv
    monkeypatch.setattr(downstream, "eval_argv", lambda *a: stand_in(real(*a)))
    logs = tmp_path / "logs" / "r"
    task = tmp_path / "my_task.yaml"
    task.write_text("task: mine\ndataset_path: json\ndoc_to_text: '{{ text }}'\n")
    d = Downstream(cfg(f"eval.tasks=[arc_easy, {task}]", "eval.interval_checkpoints=2", "eval.local=true"),
                   tmp_path, logs, True, log=lambda s: None, environ={})
    for step, final in ((10, False), (20, False), (30, False), (35, True)):
        d.checkpointed(step, final)
    markers = {m["step"]: m for m in (json.loads(f.read_text()) for f in (logs / "eval" / "pending").glob("*.json"))}
    assert sorted(markers) == [20, 35]
    argv = real("r", 20, tmp_path, ["arc_easy", str(task)])
    assert argv[3:] == ["eval", "--model", "r", "--step", "20", "--root", str(tmp_path),
                        "--tasks", f"arc_easy,{task}"]
    assert markers[20]["argv"][3:] == argv[3:] and markers[20]["scheduler"] == "local"
    assert pending_steps(logs) == {20, 35}
    # a result line ends step 20's pending state; the end of 35's job ends it too (a failed evaluation)
    (logs / "eval.jsonl").write_text(json.dumps({"run": "r", "step": 20, "tasks": {}}) + "\n")
    assert pending_steps(logs) == {35}
    subprocess.run(["kill", str(markers[35]["pid"])], check=True)
    assert _wait(lambda: pending_steps(logs) == set())


def _wait(pred, timeout=10.0):
    import time

    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_a_task_file_that_is_not_data_is_not_submitted(tmp_path):
    """The same check as `eval --tasks` (issue 32): a Jinja expression in doc_to_text submits no job."""
    task = tmp_path / "t.yaml"
    task.write_text("task: t\ndoc_to_text: \"{{ cycler.__init__.__globals__.os.popen('id').read() }}\"\n")
    said = []
    d = Downstream(cfg(f"eval.tasks=[{task}]", "eval.local=true"), tmp_path, tmp_path / "logs", True,
                   log=said.append, environ={})
    d.checkpointed(10, True)
    assert not (tmp_path / "logs" / "eval").exists() and not d.procs
    assert len(said) == 1 and "not submitted" in said[0] and "key 'doc_to_text'" in said[0], said


def test_local_scheduler_needs_the_opt_in(tmp_path):
    said = []
    d = Downstream(cfg("eval.tasks=[arc_easy]"), tmp_path, tmp_path / "logs", True, log=said.append, environ={})
    d.checkpointed(10, True)
    assert not (tmp_path / "logs" / "eval").exists() and "eval.local=true" in said[0]


def test_retention_keeps_a_checkpoint_with_a_pending_evaluation(tmp_path):
    root = tmp_path / "s"
    storage = Storage(root)
    for step in (2, 4, 6, 8):
        d = storage.run_checkpoints("r") / f"step_{step}"
        d.mkdir(parents=True)
        (d / "COMPLETE.json").write_text("{}")
    logs = storage.run_logs("r")
    (logs / "eval" / "pending").mkdir(parents=True)
    job = subprocess.Popen(stand_in(downstream.eval_argv("r", 4, root, None)))
    try:
        (logs / "eval" / "pending" / "step_4.json").write_text(json.dumps({"step": 4, "scheduler": "local",
                                                                            "pid": job.pid}))
        ck = Checkpointer(storage, "r", 0, 1, keep_last=1, log=lambda s: None)
        ck.protected = lambda: pending_steps(logs)
        ck.prune(8)
        assert [s for s, _, _ in storage.checkpoint_steps("r")] == [4, 8]   # 2 and 6 go; 4 is being evaluated
    finally:
        job.kill()
        job.wait()
    ck.prune(8)
    assert [s for s, _, _ in storage.checkpoint_steps("r")] == [8]      # its evaluation ended


def test_bad_task_names_are_one_line(tmp_path):
    p = run_cli("train", "-c", "llm_tiny", "--root", tmp_path, "--set", "eval.tasks=[--output, x]")
    assert_one_line_error(p, "eval.tasks")


def test_the_slurm_job_is_rendered_through_the_boundary(tmp_path, monkeypatch):
    """render_sbatch/sbatch_argv (pure) are what the Slurm submission writes and runs: a fake sbatch on PATH
    records its argv; the script's comment cannot be ended by a run name, the command parses back as argv."""
    import os
    import shlex

    from llmcluster.errors import UserError

    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path / 'args'}\necho 4242\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    logs = tmp_path / "lo%gs" / "r"
    d = Downstream(cfg("eval.tasks=[arc_easy]"), tmp_path, logs, True, log=lambda s: None,
                   environ={"SLURM_JOB_ID": "1"})
    d.checkpointed(10, True)
    script = logs / "eval" / "job-step_10.sh"
    args = (tmp_path / "args").read_text().splitlines()
    assert ["sbatch", *args] == downstream.sbatch_argv("r", 10, logs / "eval" / "job-step_10.log", script)
    assert args[1] == "--job-name=r-eval-10" and args[2] == f"--output={tmp_path}/lo%%gs/r/eval/job-step_10.log"
    argv = downstream.eval_argv("r", 10, tmp_path, ["arc_easy"])
    assert script.read_text() == downstream.render_sbatch("r", 10, argv)
    assert json.loads((logs / "eval" / "pending" / "step_10.json").read_text())["job_id"] == "4242"

    hostile = "r\nid > PWNED\n#\u2028x"
    word = "$(touch PWNED) `id` 'q\" {{ x }} %s --x"
    text = downstream.render_sbatch(hostile, 10, [*argv, word])
    lines = text.splitlines()
    assert len(lines) == 3 and lines[1].startswith("# llmcluster: downstream evaluation of r\\nid")
    assert shlex.split(lines[2]) == ["exec", *argv, word]
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    with pytest.raises(UserError, match="line break"):   # an argument cannot hold a line break at all
        downstream.render_sbatch("r", 10, [*argv, hostile])
    with pytest.raises(UserError, match="#SBATCH"):
        downstream.sbatch_argv(hostile, 10, logs / "x.log", script)


# -- through the Scheduler interface (issue 33): the trainer runs no scheduler tool itself ---------------------------

def test_the_trainer_calls_no_scheduler_tool_itself():
    """Submitting and polling go through launch/scheduler.py's objects: train/downstream.py starts no process."""
    import ast

    tree = ast.parse(Path(downstream.__file__).read_text())
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & {"run", "Popen", "call", "check_call", "check_output", "system"}, calls


def fake_tools(bin_dir: Path, **outputs: str) -> None:
    """Slurm CLIs on PATH that print `outputs[name]` (a missing name: the tool is not installed)."""
    import shlex

    bin_dir.mkdir(exist_ok=True)
    for name, out in outputs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\nprintf '%s' {shlex.quote(out)}\n")
        (bin_dir / name).chmod(0o755)


@pytest.mark.parametrize("tools, active", [
    ({"squeue": "RUNNING|n1\n", "scontrol": ""}, True),                      # queued or running: pending
    ({"squeue": "", "sacct": "COMPLETED|0:0|n1\n", "scontrol": ""}, False),   # ended: its checkpoint may go
    ({"squeue": "", "sacct": "", "scontrol": ""}, False),                     # Slurm no longer knows it: ended
    ({}, True),                         # Slurm cannot be asked (no squeue here): keep what it may still read
])
def test_a_slurm_evaluation_is_pending_while_slurm_says_it_is_active(tmp_path, monkeypatch, tools, active):
    logs = tmp_path / "logs" / "r"
    (logs / "eval" / "pending").mkdir(parents=True)
    fake_tools(tmp_path / "bin", **tools)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for step, job_id in ((10, "4242"), (20, "not-an-id"), (30, None)):   # a doctored id is no job of ours
        (logs / "eval" / "pending" / f"step_{step}.json").write_text(
            json.dumps({"step": step, "scheduler": "slurm", "job_id": job_id}))
    assert pending_steps(logs) == ({10} if active else set())


def test_a_recorded_pid_is_believed_only_while_it_is_that_evaluation(tmp_path):
    """pids are reused: a live process whose command line is not the evaluation of that step is not it."""
    logs = tmp_path / "logs" / "r"
    (logs / "eval" / "pending").mkdir(parents=True)
    other = subprocess.Popen(stand_in(downstream.eval_argv("r", 7, tmp_path, None)))   # evaluating step 7
    try:
        for step in (7, 8):
            (logs / "eval" / "pending" / f"step_{step}.json").write_text(
                json.dumps({"step": step, "scheduler": "local", "pid": other.pid}))
        (logs / "eval" / "pending" / "step_9.json").write_text(
            json.dumps({"step": 9, "scheduler": "no-such-scheduler", "pid": other.pid}))
        assert pending_steps(logs) == {7}
    finally:
        other.kill()
        other.wait()


def test_kubernetes_says_once_that_it_submits_no_evaluation(tmp_path):
    said = []
    d = Downstream(cfg("eval.tasks=[arc_easy]"), tmp_path, tmp_path / "logs", True, log=said.append,
                   environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    for step in (10, 20):
        d.checkpointed(step, step == 20)
    assert not (tmp_path / "logs" / "eval").exists()
    assert len(said) == 1 and "on k8s is not supported yet" in said[0], said
