"""Records are data with a shape (issue 32): events.jsonl, COMPLETE.json and job.json are checked on read, a
bad line is skipped with one note naming the file and the line, and JSON output never holds NaN/Infinity.
Output paths are checked before any work (issue 34): a missing folder, a folder, a file not ours -> one line."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, cli_inprocess
from llmcluster.storage.job_record import read_record
from llmcluster.storage.layout import check_marker, read_marker
from llmcluster.storage.events import EVENTS, EventLog, read_events
from test_goodput import EVENTS_TWO, write_events


def _no_constant(name):
    raise AssertionError(f"{name} in JSON output")


def strict_json(text: str):
    return json.loads(text, parse_constant=_no_constant)


@pytest.mark.parametrize("bad", [
    '{"t": 50, "attempt": 2, "event": "step"}',                           # no step
    '{"t": 50, "attempt": 2, "event": "checkpointed", "step": 8, "ckpt": "a"}',   # a non-numeric ckpt
    '{"t": 1e400, "attempt": 2, "event": "step", "step": 9}',            # parses as inf
    '{"t": Infinity, "attempt": 2, "event": "step", "step": 9}',         # not JSON at all
    '{"t": NaN, "attempt": 2, "event": "step", "step": 9}',
    '{"t": 50, "attempt": true, "event": "step", "step": 9}',            # a bool is no attempt number
    '{"t": 50, "attempt": 2, "event": "step", "step": -1}',
    '[1, 2]',
    # an ft line's own fields (issue 50): a list where a group number goes was a TypeError in `jobs goodput`
    '{"t": 20, "attempt": 1, "event": "ft_heal", "step": 7, "group": [1], "seconds": 0.5, "side": "receiver"}',
    '{"t": 20, "attempt": 1, "event": "ft_heal", "step": 7, "group": 1, "seconds": 1e400, "side": "receiver"}',
    '{"t": 20, "attempt": 1, "event": "ft_quorum", "step": 7, "groups": "2"}',
])
def test_goodput_skips_a_malformed_events_line_with_one_note(capsys, tmp_path, bad):
    root = tmp_path / "s"
    lines = [json.dumps(e) for e in EVENTS_TWO]
    lines.insert(5, bad)
    lines.insert(9, bad)                    # twice: still one note, naming the first line
    (root / "logs" / "r").mkdir(parents=True)
    (root / "logs" / "r" / EVENTS).write_text("\n".join(lines) + "\n")
    p = cli_inprocess(capsys, "jobs", "goodput", "r", "--root", root, "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    out = strict_json(p.stdout)
    assert out["wall_s"] == 35 and out["attempts"] == 2     # as if the bad lines were not there
    notes = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(notes) == 1 and str(root / "logs" / "r" / EVENTS) in notes[0] and "line 6" in notes[0] \
        and "1 more" in notes[0], notes
    text = cli_inprocess(capsys, "jobs", "goodput", "r", "--root", root)
    assert text.returncode == 0 and "goodput 22.9%" in text.stdout


def test_goodput_json_has_no_nan_or_infinity(capsys, tmp_path):
    """Finite times whose sums overflow (1e308 apart): the figures that become inf are null, not `Infinity`."""
    root = tmp_path / "s"
    write_events(root, "r", [{"t": 0, "attempt": 1, "event": "attempt_start", "step": 0},
                             {"t": 1.7e308, "attempt": 1, "event": "init_done", "step": 0},
                             {"t": 10, "attempt": 2, "event": "attempt_start", "step": 0},
                             {"t": 1.7e308, "attempt": 2, "event": "exit", "step": 0, "reason": "failed"}])
    p = cli_inprocess(capsys, "jobs", "goodput", "r", "--root", root, "--json")
    assert p.returncode == 0, p.stderr
    out = strict_json(p.stdout)
    assert out["wall_s"] is None


def test_events_reader_is_the_one_the_writer_uses_and_a_cut_line_does_not_swallow_the_next(tmp_path):
    log = tmp_path / EVENTS
    log.write_text('{"t": 1, "attempt": 1, "event": "attempt_start", "step": 0}\n{"t": 2, "attempt": 1, "ev')
    w = EventLog(tmp_path, enabled=True)
    w.close("completed")
    recs = read_events(log, warn=None)
    assert w.attempt == 2 and [r["event"] for r in recs] == ["attempt_start", "attempt_start", "exit"]


@pytest.mark.parametrize("text, why", [
    ("[]", "not a JSON object"), ('"x"', "not a JSON object"), ('{"step": "a", "files": {}}', "'step'"),
    ("NaN", "not JSON"), ('{"step": 4, "files": {}, "bytes": Infinity}', "not JSON"),
    ('{"step": 4, "files": []}', "'files'"), ('{"step": 5, "files": {}}', "not the directory's 4"),
    ('{"step": 4, "files": {}, "world_size": 0}', "'world_size'"),
])
def test_a_marker_not_of_its_shape_is_no_marker(tmp_path, text, why):
    d = tmp_path / "step_4"
    d.mkdir()
    (d / "COMPLETE.json").write_text(text)
    problem = check_marker(d)
    assert isinstance(problem, str) and "COMPLETE.json" in problem and why in problem, problem
    assert read_marker(d) is None
    (d / "COMPLETE.json").write_text('{"step": 4, "files": {"a": "00"}, "bytes": 3}')
    assert read_marker(d) == {"step": 4, "files": {"a": "00"}, "bytes": 3}


def test_job_record_shape(tmp_path, capsys):
    rec = tmp_path / "job.json"
    for text in ("[]", "NaN", '{"run": "r"}', '{"run": 3, "scheduler": "local"}', "{"):
        rec.write_text(text)
        assert read_record(tmp_path) is None, text
        assert str(rec) in capsys.readouterr().err
    rec.write_text(json.dumps({"run": "r", "scheduler": "local", "pid": "12", "port": [1], "state": "RUNNING",
                               "nodes": 1}))
    assert read_record(tmp_path) == {"run": "r", "scheduler": "local", "state": "RUNNING", "nodes": 1}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pid" in err[0] and "port" in err[0]


def test_jobs_cancel_of_a_live_pid_that_leads_no_process_group_is_one_line(tmp_path, capsys):
    """job.json names a live process of ours that is not its group's leader: refused in one line (no
    ProcessLookupError from killpg)."""
    import subprocess
    import sys

    logs = tmp_path / "logs" / "r"
    logs.mkdir(parents=True)
    # a process whose command line looks like the run's torchrun, in our process group (not a leader)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "torch.distributed.run",
                              str(logs / "ranks")])
    try:
        (logs / "job.json").write_text(json.dumps({"run": "r", "scheduler": "local", "pid": child.pid,
                                                   "state": "RUNNING", "job_id": f"local-{child.pid}"}))
        p = cli_inprocess(capsys, "jobs", "cancel", "r", "--root", tmp_path)
        assert_one_line_error(p, "does not lead its process group")
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


# -- output paths (issue 34 item 5) ---------------------------------------------------------------------------

@pytest.fixture
def run_root(tmp_path):
    root = tmp_path / "s"
    write_events(root, "r", EVENTS_TWO)
    return root


def _refused(capsys, *args, needle):
    p = cli_inprocess(capsys, *args)
    assert_one_line_error(p, needle)
    return p


def test_goodput_textfile_and_plot_paths_are_checked_before_work(capsys, run_root, tmp_path):
    g = ("jobs", "goodput", "r", "--root", run_root)
    _refused(capsys, *g, "--textfile", tmp_path / "nope" / "x.prom", needle="no such directory")
    _refused(capsys, *g, "--textfile", tmp_path, needle="is a directory")
    _refused(capsys, *g, "--textfile", "/etc/passwd", needle="refusing to overwrite")
    _refused(capsys, *g, "--plot", "/etc/passwd", needle="not a directory")
    _refused(capsys, *g, "--plot", tmp_path / "nope" / "deeper", needle="no such directory")
    theirs = tmp_path / "plots"
    theirs.mkdir()
    (theirs / "goodput.png").write_text("a colleague's notes")
    _refused(capsys, *g, "--plot", theirs, needle="refusing to overwrite")
    mine = tmp_path / "g.prom"
    mine.write_text("not a textfile of ours\n")
    _refused(capsys, *g, "--textfile", mine, needle="refusing to overwrite")
    # nothing was written by the refused runs; ours are overwritten on a second run
    assert mine.read_text() == "not a textfile of ours\n" and not (tmp_path / "nope").exists()
    mine.unlink()
    (theirs / "goodput.png").unlink()
    for _ in range(2):
        p = cli_inprocess(capsys, *g, "--textfile", mine, "--plot", theirs)
        assert p.returncode == 0, p.stderr
        assert f"wrote {mine}, {theirs / 'goodput.png'}" in p.stdout
    link = tmp_path / "l.prom"
    link.symlink_to(mine)
    _refused(capsys, *g, "--textfile", link, needle="refusing to overwrite")


def test_plan_plot_paths_are_checked_before_work(capsys, tmp_path):
    _refused(capsys, "plan", "seed-a100-7b", "--plot", "/etc/passwd", needle="not a directory")
    _refused(capsys, "plan", "seed-a100-7b", "--plot", tmp_path / "a" / "b", needle="no such directory")
    (tmp_path / "memory.png").write_bytes(b"GIF89a")
    _refused(capsys, "plan", "seed-a100-7b", "--plot", tmp_path, needle="memory.png")
    (tmp_path / "memory.png").unlink()
    p = cli_inprocess(capsys, "plan", "seed-a100-7b", "--plot", tmp_path / "new")
    assert p.returncode == 0 and (tmp_path / "new" / "memory.png").read_bytes()[:4] == b"\x89PNG"
    p = cli_inprocess(capsys, "plan", "seed-a100-7b", "--plot", tmp_path / "new")   # ours: overwritten
    assert p.returncode == 0, p.stderr


def test_a_fatal_end_before_the_first_step_is_a_noop_start_and_after_it_an_attempt(tmp_path):
    """A refusal after start-up (train_cli's UserError: exit_reason `fatal`) before any step trained nothing;
    a fatal end after steps (the non-finite-step limit) stays an attempt whose time the job spent."""
    from llmcluster.launch.goodput import attempts

    log = tmp_path / EVENTS
    w = EventLog(tmp_path, enabled=True)
    w.close("fatal", "resuming at another world size would change the global batch")
    w = EventLog(tmp_path, enabled=True)
    w.heartbeat(1)
    w.close("fatal", "too many bad steps")
    recs = read_events(log, warn=None)
    noops = [r for r in recs if r["event"] == "noop_start"]
    assert [(r["attempt"], r["reason"]) for r in noops] == [(1, "resuming at another world size would change "
                                                              "the global batch")]
    assert [a[0]["attempt"] for a in attempts(recs)] == [2]


# An OSC-52 clipboard write, a screen clear, a C1 CSI, a bidi override: what a colleague can put in a shared record
ESCAPES = "\x1b]52;c;cm0gLXJmIH4=\x07|\x1b[2J\x1b[H|\x9b31m|\u202e|\r\n"


def test_record_fields_reach_the_terminal_without_control_characters(tmp_path, capsys):
    root = tmp_path / "s"
    for run, kind in (("r", None), ("srv", "serve")):
        (root / "logs" / run).mkdir(parents=True)
        (root / "logs" / run / "job.json").write_text(json.dumps(
            {"run": run, "scheduler": "local", "state": f"DONE{ESCAPES}", "job_id": f"local-1{ESCAPES}",
             "submitted_at": ESCAPES, "exit_code": 0, **({"kind": kind, "endpoint": f"http://h{ESCAPES}"} if kind
                                                          else {})}))
    (root / "checkpoints" / "r").mkdir(parents=True)
    (root / "checkpoints" / "r" / ".owner.json").write_text(json.dumps({"pid": ESCAPES, "host": ESCAPES}))
    for args in (("jobs", "list", "--root", root), ("jobs", "status", "r", "--root", root),
                 ("storage", "status", "--root", root)):
        p = cli_inprocess(capsys, *args)
        assert p.returncode == 0, (args, p.stderr)
        assert "DONE" in p.stdout or "pid" in p.stdout, p.stdout
        for c in ("\x1b", "\x07", "\x9b", "\u202e", "\r"):
            assert c not in p.stdout + p.stderr, (args, c, p.stdout)
    assert "DONE]52;c;cm0gLXJmIH4=|[2J[H|31m||" in cli_inprocess(capsys, "jobs", "list", "--root", root).stdout
