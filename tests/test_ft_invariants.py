"""Issue 62's reproductions as tests, real processes (gloo, the Lighthouse, the supervisor): groups killed near the
end and slow to come back (held after their checkpoint read, a test hook) must not train the end again nor touch
the final checkpoint. Invariant 1, a committed step is final (checkpoint/checkpointer.py: set_aside); invariant 2,
the end is decided once (ft/quorum.py: record_end, end_if_finished). docs/fault-tolerance.md, "Invariants"."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from faultkit import slowed
from test_ft import _digests, _events, _job, _kill_group, _step, _supervised, _wait

pytest.importorskip("torchft")

RECORD = "FINISHED.json"


def _tree(d: Path) -> dict[str, str]:
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def _logs(root: Path, run: str, groups: int, stdout: str) -> dict[int, str]:
    """Each group's own lines: group 0's on the supervisor's stdout, the others' in logs/<run>/ft/group<g>.log."""
    ft = root / "logs" / run / "ft"
    return {0: stdout, **{g: (ft / f"group{g}.log").read_text() for g in range(1, groups)}}


def _late_groups_end_without_training(root: Path, tmp_path: Path, run: str, groups: int, last: int, late: list[int],
                                      kill_at: int, items: tuple) -> None:
    """`late` groups SIGKILLed at step `kill_at`, their restarts held 20 s after their checkpoint read; the steps
    to the end are slowed (6 s each) until both are held, so that they read a checkpoint below the end; then the
    others finish at full speed. The late groups must end without training; the final checkpoint is the writer's."""
    held = {g: root / "logs" / run / "ft" / f"group{g}.log" for g in late}
    env, go = slowed(tmp_path, f"0:0.3:1-{kill_at},0:6:{kill_at + 1}-{last}", LLMCLUSTER_TEST_FT_SLOW_START_S="20")
    final = root / "checkpoints" / run / f"step_{last}"
    with _supervised(root, run, (f"parallel.dp_replicate={groups}", *items), env) as proc:
        _wait(lambda: _step(root, run) >= kill_at, proc, f"step {kill_at}", 240)
        for g in late:
            _kill_group(root, run, g)
        _wait(lambda: all(p.is_file() and "held 20 s before its quorum" in p.read_text() for p in held.values()),
              proc, "the late groups back and held", 240)
        assert not final.exists(), "the end came before the late groups read their checkpoint: slow the steps more"
        go.touch()   # the others run to the end at full speed while the late groups are held
        _wait(lambda: (final / "COMPLETE.json").is_file(), proc, "the final checkpoint", 120)
        sealed = _tree(final)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    logs = _logs(root, run, groups, out)
    # invariant 1: the final checkpoint is the first writer's, byte for byte; nothing was set aside
    assert _tree(final) == sealed
    assert not list((root / "checkpoints" / run).glob(".abandoned-*"))
    writer = _digests(root, run, out)[0]
    assert writer[0] == last, writer
    # invariant 2: every late group ended before training a step, naming the writer's digest, not one of its own
    for g in late:
        assert f"the run finished at step {last} (weights sha256 {writer[1]}) while this group was away" in logs[g], \
            logs[g][-2000:]
        assert not re.search(rf"ft: group {g} finished at step", logs[g]), logs[g][-2000:]
        assert "already committed" not in logs[g]
    # one end: every "finished at step" line names the final step and the writer's weights; one exit completed
    finished = [(int(s), h) for text in logs.values()
                for s, h in re.findall(r"finished at step (\d+),? \(?weights sha256 ([0-9a-f]{16})", text)]
    assert set(finished) == {(last, writer[1])} and len(finished) == groups, finished
    exits = [e for e in _events(root, run) if e["event"] == "exit"]
    assert [e["reason"] for e in exits] == ["completed"], exits
    record = json.loads((root / "checkpoints" / run / RECORD).read_text())
    assert (record["step"], record["weights_sha256"], record["group"]) == (last, writer[1], 0), record
    print(f"late groups {late}: ended without training; writer's digest {writer[1]}")


@pytest.mark.slow   # real processes: 4 groups on 2 cores, ~2-3 minutes
def test_two_late_groups_of_four_do_not_train_the_end_again_nor_replace_the_final_checkpoint(tiny_root, tmp_path):
    """Issue 62's first reproduction: 4 groups, ft.min_replicas=2; groups 2 and 3 SIGKILLed at step 34 of 40 and
    slow to come back. They form a quorum of 2 on their own after the others finished: before it trains step 31
    it reads the run's end and both end."""
    items = ("ft.min_replicas=2", "train.steps=40", "checkpoint.interval_steps=10", "ft.timeout_s=60",
             "ft.quorum_timeout_s=60", "dist.timeout_s=60")
    _late_groups_end_without_training(tiny_root, tmp_path, "ft-late4", 4, 40, [2, 3], 34, items)


@pytest.mark.slow   # real processes: ~1-2 minutes
def test_a_late_group_does_not_retrain_to_stop_at_nor_replace_its_checkpoint(tiny_root, tmp_path):
    """Issue 62's second reproduction: 2 groups, train.stop_at=30 of steps=40 (the end is stop_at, not steps); group
    1 killed at 25 and slow to come back: step_30 stays the writer's, untouched, and group 1 ends without training."""
    items = ("ft.min_replicas=1", "train.steps=40", "train.stop_at=30", "checkpoint.interval_steps=10")
    _late_groups_end_without_training(tiny_root, tmp_path, "ft-stopat", 2, 30, [1], 25, items)


def test_the_end_counts_for_the_configs_last_step_above_the_group_and_names_the_recorded_digest(tmp_path):
    """end_if_finished's reading, without processes: the last step committed ends a group below it, with the
    record's digest (or says it was not recorded: a writer that died between the two); a run extended past an
    old end, a group already at the end, or an end rolled back by an operator (its step moved aside) trains on."""
    from types import SimpleNamespace

    from llmcluster.config.schema import TrainConfig
    from llmcluster.ft.quorum import _recorded_end
    from llmcluster.storage.layout import COMPLETE_MARKER, Storage

    storage = Storage(tmp_path)
    ckpts = storage.run_checkpoints("r")

    def end(step: int, **train):
        t = SimpleNamespace(cfg=SimpleNamespace(run=SimpleNamespace(name="r"), train=TrainConfig(**train)),
                            storage=storage, ckpt=SimpleNamespace(dir=ckpts), step=step)
        return _recorded_end(t)

    assert end(18, steps=24) is None                                   # nothing committed at the end
    (ckpts / "step_24").mkdir(parents=True)
    (ckpts / "step_24" / COMPLETE_MARKER).write_text("{}")
    assert end(18, steps=24) == (24, "not recorded: its writer left before recording it")
    (ckpts / RECORD).write_text(json.dumps({"step": 24, "weights_sha256": "ab" * 8, "group": 0}))
    assert end(18, steps=24) == (24, "ab" * 8)
    assert end(24, steps=24) is None                                   # at the end already: nothing to do
    assert end(18, steps=40) is None                                   # extended: the old end is not this one
    assert end(18, steps=40, stop_at=24) == (24, "ab" * 8)             # stop_at is the end when it comes first
    (ckpts / RECORD).write_text("[not a record")
    assert end(18, steps=24) == (24, "not recorded: its writer left before recording it")
    (ckpts / "step_24").rename(tmp_path / "aside")                     # an operator's roll-back
    assert end(18, steps=24) is None


@pytest.mark.slow   # real processes: ~1-2 minutes on a loaded 2-core machine
def test_a_group_hung_while_its_process_lives_leaves_by_its_watchdog_and_the_other_goes_on(tiny_root, tmp_path):
    """Issue 62's third reproduction, invariant 3 (ft/watchdog.py): 2 groups, ft.min_replicas=1; group 1's training
    thread blocks for good before step 6's all-reduce while its process (and torchft's heartbeat) lives. Without
    the watchdog the Lighthouse forms no quorum without more than half of the heartbeating groups, so group 0
    commits nothing for as long as group 1 hangs (this test then times out waiting for group 0 alone). With it,
    group 1 records a `hang` event and SIGKILLs itself within ft.step_deadline_s; group 0 goes on alone, group 1
    is started again and heals; both finish with the same weights; exit 0; only group 1 is blamed."""
    run, steps, hang = "ft-hang", 40, 6
    items = ("ft.min_replicas=1", f"train.steps={steps}", "checkpoint.interval_steps=10", "ft.timeout_s=8",
             "ft.quorum_timeout_s=10", "ft.step_deadline_s=25", "log.interval=1")
    # group 0 held 1.5 s a step until group 1 is back: room for a restart and heal on a loaded 2-core machine
    env, go = slowed(tmp_path, "0:1.5", LLMCLUSTER_TEST_FT_HANG_AT_STEP=f"1:{hang}")

    def quorum(groups: int, after: int):
        return lambda: any(e["event"] == "ft_quorum" and e["groups"] == groups and e["step"] >= after
                           for e in _events(tiny_root, run))
    with _supervised(tiny_root, run, items, env) as proc:
        _wait(quorum(2, 0), proc, "both groups in a quorum")
        pid0 = _job(tiny_root, run)["ft"]["groups"][0]["pid"]
        _wait(quorum(1, hang - 1), proc, "a quorum of group 0 alone after group 1 hung", 150)
        _wait(lambda: any(e["event"] == "hang" for e in _events(tiny_root, run)), proc, "the hang event", 30)
        alone = _step(tiny_root, run)
        _wait(lambda: _step(tiny_root, run) >= alone + 2, proc, "steps committed by group 0 alone")
        _wait(quorum(2, alone), proc, "group 1 back in the quorum", 150)
        go.touch()
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    events = _events(tiny_root, run)
    hangs = [e for e in events if e["event"] == "hang"]
    # the hook blocks the first step at or after `hang` that group 1 runs itself (a group that started late heals
    # past step `hang`: CI's AVX2 machine), so the step is checked against the hook's rule, not a number
    assert [e["group"] for e in hangs] == [1] and hangs[0]["step"] >= hang, hangs
    assert 25 <= hangs[0]["waited_s"] < 60 and hangs[0]["deadline_s"] == 25, hangs
    assert [e["group"] for e in events if e["event"] == "ft_group_failed"] == [1]   # the group that hung, only
    job = _job(tiny_root, run)
    assert job["ft"]["groups"][0]["pid"] == pid0 and job["ft"]["groups"][0]["restarts"] == 0, job
    assert job["ft"]["groups"][1]["restarts"] == 1, job
    heals = [e for e in events if e["event"] == "ft_heal" and e["group"] == 1 and e["step"] >= hangs[0]["step"]]
    assert heals and all(e["peer"] == 0 for e in heals), heals
    log1 = (tiny_root / "logs" / run / "ft" / "group1.log").read_text()
    assert f"ft: group 1 made no progress on step {hangs[0]['step']} for" in log1, log1[-3000:]
    digests = _digests(tiny_root, run, out)
    assert digests[0] == digests[1] and digests[0][0] == steps, digests
    print(f"group 1 hung at step {hangs[0]['step']}: left after {hangs[0]['waited_s']} s; finished {digests[0]}")


def test_a_quorum_behind_a_committed_step_stops_instead_of_training_another_trajectory(tmp_path):
    """The schedule explorer's seed 3 (tests/test_ft_schedules.py): a restarted group whose checkpoint read raced
    the writer's save and retention started at step 0, then, the writer's group gone, formed a quorum of its own
    and trained the run again from scratch (another digest on its finished line). After its quorum and any heal, a
    group below the run's newest committed step stops (its launcher resumes it from that step); while it waits for
    a quorum (a heal may still come) it does not."""
    from types import SimpleNamespace

    from llmcluster.config.schema import TrainConfig
    from llmcluster.errors import RunFailure
    from llmcluster.ft.quorum import end_if_finished
    from llmcluster.storage.layout import COMPLETE_MARKER, Storage

    storage = Storage(tmp_path)
    ckpts = storage.run_checkpoints("r")
    for n in (25, 30):
        (ckpts / f"step_{n}").mkdir(parents=True)
        (ckpts / f"step_{n}" / COMPLETE_MARKER).write_text("{}")
    (ckpts / "step_35").mkdir()                                       # a write in flight: not committed

    def group_at(step: int):
        t = SimpleNamespace(cfg=SimpleNamespace(run=SimpleNamespace(name="r"), train=TrainConfig(steps=40)),
                            storage=storage, ckpt=SimpleNamespace(dir=ckpts), step=step,
                            env=SimpleNamespace(rank=0, distributed=False))
        return SimpleNamespace(t=t, group=1, ended=False)

    with pytest.raises(RunFailure, match="its quorum is at step 0, behind step 30 the run committed"):
        end_if_finished(group_at(0), behind=True)
    end_if_finished(group_at(0))                                      # waiting for a quorum: a heal may come
    end_if_finished(group_at(30), behind=True)                        # at the newest committed step: trains on
    end_if_finished(group_at(33), behind=True)
