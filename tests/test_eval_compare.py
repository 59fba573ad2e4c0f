"""`eval --compare` reads eval.jsonl as data with a shape (issue 32, Low; issue 34): a malformed line is skipped
with one note naming the file and line, never a traceback; `--json` never holds NaN or Infinity; the table and
the plot show each score's 95% confidence interval, so noise does not read as progress."""

from __future__ import annotations

import json
import re

from conftest import cli_inprocess

GOOD = {"run": "r", "step": 20, "tokens": 200, "endpoint": None, "backend": "hf",
        "tasks": {"mc": {"metrics": {"acc": 0.4}, "stderr": {"acc": 0.05}}}}
BAD = [
    "{not json",                                                   # not JSON
    "[1, 2]",                                                      # not an object
    '"text"',
    json.dumps({**GOOD, "step": "20"}),                            # wrong types
    json.dumps({**GOOD, "tokens": True}),
    json.dumps({**GOOD, "run": 7}),
    json.dumps({**GOOD, "tasks": ["mc"]}),
    json.dumps({**GOOD, "tasks": {"mc": "0.4"}}),
    json.dumps({**GOOD, "tasks": {"mc": {"metrics": {"acc": "high"}}}}),
    json.dumps({**GOOD, "step": 30}).replace("0.4", "NaN"),        # NaN / Infinity / 1e400 scores
    json.dumps({**GOOD, "step": 30}).replace("0.05", "Infinity"),
    json.dumps({**GOOD, "step": 30}).replace("0.4", "1e400"),
    json.dumps({k: v for k, v in GOOD.items() if k != "tasks"}),   # missing keys
    json.dumps({k: v for k, v in GOOD.items() if k != "run"}),
    "[" * 100000,                                                  # deep nesting
]


def _log(tmp_path, lines):
    logs = tmp_path / "logs" / "r"
    logs.mkdir(parents=True)
    (logs / "eval.jsonl").write_text("\n".join(lines) + "\n")
    return logs / "eval.jsonl"


def test_malformed_lines_are_skipped_with_one_note_each(capsys, tmp_path):
    path = _log(tmp_path, [*BAD, json.dumps(GOOD)])
    out = cli_inprocess(capsys, "eval", "--compare", "r", "--root", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    notes = out.stderr.strip().splitlines()
    assert len(notes) == len(BAD) and "Traceback" not in out.stderr
    assert [int(re.search(r"eval\.jsonl:(\d+): skipped", n).group(1)) for n in notes] == list(range(1, len(BAD) + 1))
    assert all(str(path) in n for n in notes)
    rows = json.loads(out.stdout, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(c)))["rows"]
    assert [(r["step"], r["tasks"]["mc"]["metrics"]["acc"]) for r in rows] == [(20, 0.4)]


def test_the_table_shows_a_95_percent_interval_and_the_plot_error_bars(capsys, tmp_path):
    _log(tmp_path, [json.dumps(GOOD), json.dumps({**GOOD, "step": 40, "tokens": 400})])
    out = cli_inprocess(capsys, "eval", "--compare", "r", "--root", tmp_path, "--plot", tmp_path / "plots")
    assert out.returncode == 0, out.stderr
    assert "0.4000 ± 0.0980" in out.stdout and "95% confidence" in out.stdout   # 1.96 × 0.05
    assert (tmp_path / "plots" / "eval_compare.png").stat().st_size > 1000


def test_a_plot_path_that_is_not_a_directory_is_one_line_before_work(capsys, tmp_path):
    from conftest import assert_one_line_error

    _log(tmp_path, [json.dumps(GOOD)])
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    (tmp_path / "d" / "eval_compare.png").mkdir(parents=True)
    for plot, needle in ((a_file, "not a directory"), (a_file / "sub", "no such directory"),
                         (tmp_path / "d", "is a directory")):
        assert_one_line_error(cli_inprocess(capsys, "eval", "--compare", "r", "--root", tmp_path, "--plot", plot),
                              "--plot", needle)
    assert a_file.read_text() == "mine"


def test_eval_prints_the_same_interval_as_the_compare_table():
    """Issue 53: `eval` printed ± stderr where `eval --compare` shows ± the 95% interval for the same score."""
    from llmcluster.eval.evaluate import summary_lines

    lines = summary_lines({"step": 3, "tokens": 100, "run": "r", "endpoint": None, "backend": "hf", "wall_s": 3,
                           "tasks": {"t": {"metrics": {"acc": 0.4}, "stderr": {"acc": 0.05}, "n": 40}},
                           "harness": {"results": "/x/y/z.json"}})
    assert "0.4000 ± 0.0980" in lines[1] and "95% confidence interval" in lines[0]   # 1.96 × 0.05, as --compare
