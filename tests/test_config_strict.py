"""Configs read strictly (issue 64): a duplicate YAML key in any file we read is refused in one line naming the
key and both lines (PyYAML keeps the last one silently), and a plan, a cluster spec or a job config given where
another kind is expected is named as what it is, with the command it is for."""

from __future__ import annotations

import pytest

from conftest import REPO, assert_one_line_error, cli_inprocess
from llmcluster.errors import UserError

PLAN = REPO / "llmcluster" / "assets" / "plans" / "seed-a100-7b.yaml"
CLUSTER = REPO / "llmcluster" / "assets" / "clusters" / "h200-8x.yaml"
JOB = REPO / "llmcluster" / "assets" / "configs" / "llm_tiny.yaml"


def _with_duplicate(src, dst, key: str):
    """`src` with its top-level `key:` line written twice (the first copy stays first, as a user's paste would)."""
    lines = src.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"{key}:"))
    dst.write_text("\n".join(lines + [lines[at]]) + "\n")
    return dst, at + 1, len(lines) + 1


@pytest.mark.parametrize("kind,src,key,argv", [
    ("job", JOB, "run", lambda f, tmp: ["train", "-c", f, "--root", tmp / "s"]),
    ("serve", JOB, "run", lambda f, tmp: ["serve", "plan", "--model", "llm_tiny", "-c", f, "--root", tmp / "s"]),
    ("plan", PLAN, "model", lambda f, tmp: ["plan", f]),
    ("cluster", CLUSTER, "name", lambda f, tmp: ["cluster", "show", "--cluster", f]),
])
def test_duplicate_key_is_one_line_naming_key_and_lines(capsys, tmp_path, kind, src, key, argv):
    f, first, second = _with_duplicate(src, tmp_path / f"{kind}.yaml", key)
    proc = cli_inprocess(capsys, *argv(f, tmp_path))
    assert_one_line_error(proc, str(f), f"duplicate key '{key}' at line {second} (also at line {first})")
    assert not (tmp_path / "s" / "checkpoints").exists()   # nothing trained


def test_duplicate_key_in_an_eval_task_and_a_set_value(tmp_path):
    from llmcluster.config.load import parse_override
    from llmcluster.eval import taskdata

    task = tmp_path / "t.yaml"
    task.write_text("task: mine\ndataset_path: x\ntask: again\n")
    with pytest.raises(UserError, match=r"--tasks t.yaml: duplicate key 'task' at line 3 \(also at line 1\)"):
        taskdata.load(task, "t.yaml")
    with pytest.raises(UserError, match=r"duplicate key 'a' at line 1"):
        parse_override("train={a: 1, a: 2}")


def test_merge_keys_still_override_what_they_merge():
    from llmcluster.config import strict_yaml

    assert strict_yaml.load("b: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n")["c"] == {"x": 3, "y": 2}


@pytest.mark.parametrize("argv,needles", [
    (["train", "-c", PLAN], [f"{PLAN} is a plan, not a job config", "`llmcluster plan FILE`"]),
    (["train", "-c", CLUSTER], [f"{CLUSTER} is a cluster spec, not a job config", "`--cluster FILE`"]),
    (["plan", CLUSTER], [f"{CLUSTER} is a cluster spec, not a plan", "`--cluster FILE`"]),
    (["plan", "seed-a100-7b", "--cluster", PLAN], [f"{PLAN} is a plan, not a cluster spec", "`llmcluster plan"]),
    (["cluster", "show", "--cluster", JOB], [f"{JOB} is a job config, not a cluster spec", "`llmcluster train -c"]),
])
def test_crossed_files_are_named_as_what_they_are(capsys, tmp_path, argv, needles):
    proc = cli_inprocess(capsys, *argv, *(["--root", tmp_path / "s"] if argv[0] == "train" else []))
    assert_one_line_error(proc, *needles)
