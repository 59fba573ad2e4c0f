"""`jobs goodput` on synthetic events.jsonl files (issue 28): every second of the attempts' wall time lands
in exactly one bucket, time between attempts is queued (not badput), progress past the checkpoint the next
attempt restored is lost, and `plan --json` predicts the same keys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import assert_one_line_error, run_cli
from llmcluster.launch.goodput import BUCKETS, goodput
from llmcluster.storage.events import EVENTS


def ev(t, attempt, event, step, **kw):
    return {"t": t, "attempt": attempt, "event": event, "step": step, **kw}


# attempt 1: 10 s startup, steps 1-4, a 2 s save of step 4, steps 5-7, then killed (no exit line).
# attempt 2, 6 s later: restores step 4 (5 s startup, 2 s restore, 1 s to init_done), a 2 s eval, steps 5-8,
# a 1 s save of step 8, 1 s to exit.
EVENTS_TWO = [
    ev(0, 1, "attempt_start", 0), ev(10, 1, "init_done", 0),
    *[ev(10 + k, 1, "step", k) for k in range(1, 5)],
    ev(14, 1, "save_start", 4, ckpt=4), ev(16, 1, "save_end", 4, ckpt=4), ev(16, 1, "checkpointed", 4, ckpt=4),
    *[ev(12 + k, 1, "step", k) for k in range(5, 8)],
    ev(25, 2, "attempt_start", 0), ev(30, 2, "restore_start", 0), ev(32, 2, "restore_end", 4),
    ev(33, 2, "init_done", 4), ev(33, 2, "eval_start", 4), ev(35, 2, "eval_end", 4),
    *[ev(31 + k, 2, "step", k) for k in range(5, 9)],
    ev(39, 2, "save_start", 8, ckpt=8), ev(40, 2, "save_end", 8, ckpt=8), ev(40, 2, "checkpointed", 8, ckpt=8),
    ev(41, 2, "exit", 8, reason="completed"),
]


def test_buckets_of_a_killed_and_a_resumed_attempt():
    g = goodput(EVENTS_TWO)
    assert g["attempts"] == 2 and g["wall_s"] == 35 and g["queued_s"] == 6
    assert g["productive_s"] == 8
    assert g["badput_s"] == {"startup": 16, "checkpoint_restore": 2, "checkpoint_save": 3, "eval": 2,
                             "lost_progress": 3, "hang_or_straggler": 0, "failure": 0, "other": 1}
    assert g["productive_s"] + sum(g["badput_s"].values()) == g["wall_s"] and g["unaccounted_s"] == 0
    assert g["recomputed_steps"] == 3 and g["step_time_s"] == 1
    assert math.isclose(g["goodput"], 8 / 35)


def test_a_stalled_step_is_hang_or_straggler_and_a_slow_first_step_is_startup():
    """Steps take 1 s; step 1 (warm-up) takes 6 s and step 5 (a stuck collective) 11 s: each keeps one
    median step of training and its excess goes to startup and hang_or_straggler."""
    times = [0, 1, 7, 8, 9, 10, 21, 22, 23]      # attempt_start, init_done, steps 1..7
    events = [ev(times[0], 1, "attempt_start", 0), ev(times[1], 1, "init_done", 0),
              *[ev(times[1 + k], 1, "step", k) for k in range(1, 8)],
              ev(23, 1, "save_start", 7, ckpt=7), ev(24, 1, "save_end", 7, ckpt=7),
              ev(24, 1, "checkpointed", 7, ckpt=7), ev(24, 1, "exit", 7, reason="completed")]
    g = goodput(events)
    assert g["step_time_s"] == 1 and g["productive_s"] == 7
    assert g["badput_s"]["hang_or_straggler"] == 10 and g["badput_s"]["startup"] == 1 + 5
    assert g["productive_s"] + sum(g["badput_s"].values()) == g["wall_s"] == 24


def test_failed_exit_tail_and_unfinished_last_attempt():
    """A failed exit's tail (the step in flight, the failure's detection) is `failure`; the last attempt
    of a run that has not finished keeps only what its last durable checkpoint holds."""
    events = [ev(0, 1, "attempt_start", 0), ev(1, 1, "init_done", 0),
              *[ev(1 + k, 1, "step", k) for k in range(1, 4)],
              ev(4, 1, "save_start", 3, ckpt=3), ev(5, 1, "save_end", 3, ckpt=3),
              ev(5, 1, "checkpointed", 3, ckpt=3), ev(6, 1, "step", 4), ev(7, 1, "step", 5),
              ev(10, 1, "exit", 5, reason="failed")]
    g = goodput(events)
    assert g["productive_s"] == 3 and g["badput_s"]["lost_progress"] == 2 and g["badput_s"]["failure"] == 3
    assert g["badput_s"]["startup"] == 1 and g["badput_s"]["checkpoint_save"] == 1 and g["wall_s"] == 10


def test_an_attempt_that_died_in_startup_is_all_startup_and_the_next_restore_decides():
    events = [ev(0, 1, "attempt_start", 0), ev(3, 1, "restore_start", 0),   # killed while restoring
              ev(10, 2, "attempt_start", 0), ev(11, 2, "init_done", 0), ev(12, 2, "step", 1),
              ev(13, 2, "exit", 1, reason="completed")]
    g = goodput(events)
    assert g["badput_s"]["startup"] == 4 and g["queued_s"] == 7 and g["productive_s"] == 1


def write_events(root: Path, run: str, events: list[dict], junk: str = "") -> None:
    logs = root / "logs" / run
    logs.mkdir(parents=True)
    (logs / EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events) + junk)


def test_cli_json_text_textfile_and_plot(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    root = tmp_path / "s"
    write_events(root, "r", EVENTS_TWO, junk='{"t": 99, "attempt": 2, "ev')    # a line cut by a crash: skipped
    p = run_cli("jobs", "goodput", "r", "--root", root, "--json", "--plan", "seed-a100-7b",
                "--textfile", tmp_path / "g.prom", "--plot", tmp_path / "plots", check=True)
    out = json.loads(p.stdout)
    assert out["wall_s"] == 35 and out["badput_s"]["other"] == 1 and out["goodput"] == pytest.approx(8 / 35)
    assert set(out["plan"]["badput"]) == set(out["badput_s"]) == set(BUCKETS)
    assert (tmp_path / "plots" / "goodput.png").stat().st_size > 1000
    fams = {f.name: f for f in text_string_to_metric_families((tmp_path / "g.prom").read_text())}
    secs = {s.labels["bucket"]: s.value for s in fams["llmcluster_goodput_seconds"].samples}
    assert secs["productive"] == 8 and secs["lost_progress"] == 3 and secs["queued"] == 6
    assert fams["llmcluster_goodput_ratio"].samples[0].value == pytest.approx(8 / 35)
    text = run_cli("jobs", "goodput", "r", "--root", root, check=True).stdout
    assert "goodput 22.9%" in text and "lost_progress" in text and "[" in text


def test_cli_unknown_run_is_one_line(tmp_path):
    assert_one_line_error(run_cli("jobs", "goodput", "nope", "--root", tmp_path), "events.jsonl")


def test_plan_json_predicts_the_same_buckets():
    r = json.loads(run_cli("plan", "seed-a100-7b", "--json", check=True).stdout)["time"]
    assert set(r["badput"]) == set(BUCKETS) == set(r["badput_s"])
    assert math.isclose(r["goodput"] + sum(r["badput"].values()), 1.0)
    assert math.isclose(sum(r["badput_s"].values()), (1 - r["goodput"]) * r["wall_s"])
    assert r["badput"]["lost_progress"] > 0 and r["badput"]["checkpoint_save"] > 0


def test_the_plans_model_fed_with_the_runs_own_measurements():
    """C, R, MTBF and the interval measured from the events give Young/Daly's prediction per bucket."""
    from llmcluster.launch.goodput import model

    events = [ev(0, 1, "attempt_start", 0), ev(2, 1, "init_done", 0), *[ev(2 + k, 1, "step", k) for k in (1, 2)],
              ev(4, 1, "save_start", 2, ckpt=2), ev(5, 1, "save_end", 2), ev(5, 1, "checkpointed", 2, ckpt=2),
              *[ev(3 + k, 1, "step", k) for k in (3, 4)],
              ev(7, 1, "save_start", 4, ckpt=4), ev(8, 1, "save_end", 4), ev(8, 1, "checkpointed", 4, ckpt=4),
              ev(9, 1, "step", 5),                                                                   # killed
              ev(11, 2, "attempt_start", 0), ev(13, 2, "restore_start", 0), ev(14, 2, "restore_end", 4),
              ev(15, 2, "init_done", 4), ev(16, 2, "step", 5), ev(17, 2, "exit", 5, reason="completed")]
    g = goodput(events)
    assert g["wall_s"] == 15 and g["step_time_s"] == 1
    m = model(events, g)
    assert m["inputs"] == {"write_s": 1, "restart_s": 4, "read_s": 1, "mtbf_s": 15, "interval_s": 2}
    assert m["badput"]["startup"] == pytest.approx(3 / 15) and m["badput"]["lost_progress"] == pytest.approx(1 / 15)
    assert m["badput"]["checkpoint_save"] == pytest.approx(1 / 2)
    assert m["goodput"] == pytest.approx(1 - 3 / 15 - 1 / 15 - 1 / 2 - 1 / 15)
    assert model(EVENTS_TWO, goodput(EVENTS_TWO)) is not None
    assert model(EVENTS_TWO[:12], goodput(EVENTS_TWO[:12])) is None     # one attempt, never interrupted twice


def _quorum(t, step, *groups, of=2):
    return ev(t, 1, "ft_quorum", step, groups=len(groups), of=of, replica_ids=[f"llmcluster_group_{g}" for g in groups])


def test_ft_goodput_is_the_runs_across_all_its_groups():
    """Issue 52: an ft run of 2 groups (the writer's records, shaped as ft/group.py and launch/ft_local.py write them).
    Steps take 1 s. Group 1 is SIGKILLed during step 4 (that step takes 4 s: the all-reduce fails, the quorum
    goes on without it, the step is retried), is down for steps 5-8 (committed by group 0 alone), heals and is
    back from step 9 (step 4 too was committed by group 0 alone); later it is dropped as a straggler for steps
    12-13. A step committed by k of n groups is k/n productive; the missing group's share is its restart
    (startup) once it failed, else its hang or straggling."""
    events = [ev(0, 1, "attempt_start", 0), ev(2, 1, "init_done", 0), _quorum(2, 0, 0, 1)]
    t, steps = 2.0, {4: 4.0}
    for k in range(1, 15):
        t += steps.get(k, 1.0)
        events.append(ev(t, 1, "step", k))
        if k == 3:
            events += [ev(t + 0.5, 1, "ft_group_failed", 3, group=1, pids=[4242], exit_code=-9),
                       _quorum(t + 3.5, 3, 0)]                        # the retried step 4's quorum: group 0 alone
        if k == 8:
            events += [_quorum(t + 0.1, 8, 0, 1), ev(t + 0.2, 1, "ft_heal", 8, group=1, peer=0, bytes=2e6,
                                                   seconds=0.1, side="sender")]
        if k == 11:
            events += [ev(t, 1, "ft_straggler", 11, group=1, busy_s=3.0, median_s=1.0, steps=3),
                       _quorum(t + 0.1, 11, 0)]
        if k == 13:
            events.append(_quorum(t + 0.1, 13, 0, 1))
    events += [ev(t, 1, "save_start", 14, ckpt=14), ev(t + 1, 1, "save_end", 14, ckpt=14),
               ev(t + 1, 1, "checkpointed", 14, ckpt=14), ev(t + 2, 1, "exit", 14, reason="completed")]
    events.sort(key=lambda e: e["t"])
    g = goodput(events)
    assert g["wall_s"] == 2 + 17 + 2 and g["step_time_s"] == 1
    # 14 steps of 1 s (step 4's 3 s excess: failure); steps 4-8 and 12-13 half productive
    assert g["productive_s"] == pytest.approx(14 - 5 * 0.5 - 2 * 0.5)
    assert g["badput_s"]["failure"] == 3 and g["badput_s"]["startup"] == pytest.approx(2 + 5 * 0.5)
    assert g["badput_s"]["hang_or_straggler"] == pytest.approx(2 * 0.5)
    assert g["productive_s"] + sum(g["badput_s"].values()) == pytest.approx(g["wall_s"])
    assert g["ft"]["groups"] == 2 and g["ft"]["steps_fewer_groups"] == 7 and g["ft"]["group_failures"] == 1
    # group 1 hung instead (no exit recorded: nothing failed): its share of steps 4-8 and step 4's excess are
    # hang_or_straggler; had the hung group been killed during step 6, steps 6-8 would be its restart again
    hung = [e for e in events if e["event"] != "ft_group_failed"]
    h = goodput(hung)
    assert h["productive_s"] == pytest.approx(g["productive_s"]) and h["badput_s"]["failure"] == 0
    assert h["badput_s"]["startup"] == 2 and h["badput_s"]["hang_or_straggler"] == pytest.approx(3 + 7 * 0.5)
    killed = sorted(hung + [ev(10.5, 1, "ft_group_failed", 6, group=1, pids=[4242], exit_code=-9)],
                    key=lambda e: e["t"])
    assert goodput(killed)["badput_s"]["startup"] == pytest.approx(2 + 3 * 0.5)
    # a run recorded before `of` (the most groups seen) and without the ids (missing groups by count) reads the same
    old = [{k: v for k, v in e.items() if k not in ("of", "replica_ids")} for e in events]
    assert goodput(old)["productive_s"] == pytest.approx(g["productive_s"])
    # of 4 groups, one away: a quarter of each of those steps is lost
    four = [{**e, "of": 4, "groups": e["groups"] + 2, "replica_ids": e["replica_ids"] + ["llmcluster_group_2",
             "llmcluster_group_3"]} if e["event"] == "ft_quorum" else e for e in events]
    assert goodput(four)["productive_s"] == pytest.approx(14 - 7 * 0.25)
