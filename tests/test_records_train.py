"""The real trainer (in-process, as test_fault_checkpoint) against records it reads back and writes:
a completion marker that is valid JSON but not a marker (issue 32 #6) makes resume fall back to the previous
checkpoint with one warning line; starts that train nothing are recorded as no-op starts and leave the run's
goodput as it was (issue 34 item 1)."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from faultkit import make_dataset, sets
from llmcluster.cli import main
from llmcluster.launch.goodput import run_goodput
from llmcluster.storage.events import EVENTS, NOOP


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 8 steps (checkpoints at 4 and 8) trained once without interruption."""
    root = make_dataset(tmp_path_factory.mktemp("records") / "storage")
    assert main(["train", "-c", "llm_tiny", "--root", str(root),
                 *sets(train__steps=8, checkpoint__interval_steps=4)]) == 0
    return root


@pytest.fixture
def root(trained, tmp_path):
    """A copy of the trained run's storage, for one test to change."""
    r = tmp_path / "storage"
    shutil.copytree(trained, r, symlinks=True)
    return r


def train(capsys, root, *extra, steps=8):
    code = main(["train", "-c", "llm_tiny", "--root", str(root),
                 *sets(train__steps=steps, checkpoint__interval_steps=4), *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("marker", ["[]", '"x"', '{"step": "a", "files": {}}', "NaN"])
def test_a_marker_that_is_json_but_no_marker_falls_back_to_the_previous_checkpoint(capsys, root, marker):
    step8 = root / "checkpoints" / "llm-tiny" / "step_8"
    (step8 / "COMPLETE.json").write_text(marker)
    code, out, err = train(capsys, root)
    assert code == 0 and "Traceback" not in err, err
    warnings = [ln for ln in (out + err).splitlines() if "COMPLETE.json" in ln]
    assert len(warnings) == 1 and re.search(r"warning: skipping checkpoint .*step_8: COMPLETE\.json is not", warnings[0])
    assert "resumed from" in out and "step_4 (step 4)" in out
    assert json.loads((step8 / "COMPLETE.json").read_text())["step"] == 8     # step 8 trained and sealed again


NOOPS = {   # each kind of start that trains nothing: its arguments, exit code, and the reason it records
    "finished": ((), 0, "already at step 8 of 8; nothing to do"),
    "resume-never": (("--resume", "never"), 2, "already has checkpoints up to step 8"),
    "resume-bad-path": (("--resume", "/nonexistent/step_3"), 2, "no such checkpoint directory"),
}


def _noops(root):
    lines = (root / "logs" / "llm-tiny" / EVENTS).read_text().splitlines()
    return [e["reason"] for e in map(json.loads, lines) if e["event"] == NOOP]


@pytest.mark.parametrize("kind", NOOPS)
def test_a_start_that_trains_nothing_is_a_noop_start(capsys, root, kind):
    args, code, reason = NOOPS[kind]
    before = run_goodput(root, "llm-tiny")
    got, out, err = train(capsys, root, *args)
    assert got == code, (out, err)
    assert len(_noops(root)) == 1 and reason in _noops(root)[0]
    assert run_goodput(root, "llm-tiny") == before


def test_goodput_of_a_run_trained_once_then_started_three_times_for_nothing(capsys, root):
    """Acceptance (issue 34): one attempt, the same goodput as before the no-op starts."""
    before = json.loads(main_out(capsys, "jobs", "goodput", "llm-tiny", "--root", str(root), "--json"))
    assert before["attempts"] == 1
    for args, code, _ in NOOPS.values():
        assert train(capsys, root, *args)[0] == code
    assert len(_noops(root)) == 3
    after = json.loads(main_out(capsys, "jobs", "goodput", "llm-tiny", "--root", str(root), "--json"))
    assert after == before
    text = main_out(capsys, "jobs", "goodput", "llm-tiny", "--root", str(root))
    assert "1 attempt(s)" in text and f"goodput {before['goodput']:.1%}" in text


def main_out(capsys, *args) -> str:
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out
