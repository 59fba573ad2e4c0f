"""Task files are data (issue 32, High #2): `eval --tasks FILE.yaml` runs no code a task file names — not through
an `include:` whose base holds `!function`, not through a Jinja `doc_to_text` — and refuses it in one line
naming the file and key before the harness starts. A task that includes a base of allowed keys still runs
through the real lm-evaluation-harness.

The attacks are run on a real (tiny, random) Hugging Face model, so that on the code before the fix they reach
the real harness and leave their marker file (checked once by hand against the old code: both markers
appeared and `eval` exited 0); with the fix they never start it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_one_line_error, cli_inprocess
from llmcluster.eval import taskdata
from llmcluster.eval.tasks import TASKS_DIR, resolve, shipped


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from hf_helpers import make_hf_llama, make_hf_tokenizer

    out = tmp_path_factory.mktemp("m") / "tinyhf"
    make_hf_tokenizer(out)
    return make_hf_llama(out, vocab=384)


def _data(tmp_path: Path) -> Path:
    p = tmp_path / "docs.jsonl"
    p.write_text("".join(json.dumps({"context": f"x = {i}", "target": f" + {i}"}) + "\n" for i in range(4)))
    return p


def _base(tmp_path: Path, **extra: str) -> dict:
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(_data(tmp_path))}},
            "test_split": "test", "output_type": "loglikelihood", "doc_to_text": "context",
            "doc_to_target": "target", "metric_list": [{"metric": "perplexity", "aggregation": "perplexity"}],
            "metadata": {"version": 1.0}, **extra}


def _write(path: Path, doc: dict | str) -> Path:
    import yaml

    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc))
    return path


def _eval(capsys, model: Path, tmp_path: Path, task: Path):
    return cli_inprocess(capsys, "eval", "--model", model, "--tasks", task, "--limit", "2",
                         "--root", tmp_path / "storage")


def test_an_included_base_with_a_function_runs_nothing(capsys, model, tmp_path):
    marker = tmp_path / "MARKER_INCLUDE"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                      f"def fn(ds):\n    open({str(marker)!r}, 'w').write('ran')\n    return ds\n")
    base = _write(tmp_path / "base.yaml", "process_docs: !function evil.fn\n")
    task = _write(tmp_path / "t.yaml", {"task": "t_inc", "include": str(base), **_base(tmp_path)})
    assert_one_line_error(_eval(capsys, model, tmp_path, task), str(base), "not a task YAML we can read as data")
    assert not marker.exists()
    # the same base written without the tag: the key itself is refused, naming it
    _write(base, "process_docs: evil.fn\n")
    assert_one_line_error(_eval(capsys, model, tmp_path, task), str(base), "key 'process_docs'")
    assert not marker.exists()


def test_a_jinja_doc_to_text_runs_no_shell(capsys, model, tmp_path):
    marker = tmp_path / "MARKER_JINJA"
    attack = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}"
    task = _write(tmp_path / "t.yaml", {"task": "t_jinja", **_base(tmp_path, doc_to_text=attack)})
    assert_one_line_error(_eval(capsys, model, tmp_path, task), str(task), "key 'doc_to_text'")
    assert not marker.exists()


@pytest.mark.parametrize("key,value", [
    ("doc_to_text", "{{ context.upper() }}"), ("doc_to_text", "{% for x in y %}{% endfor %}"),
    ("doc_to_text", "{{{ context }}"), ("doc_to_text", "{{- context }}"), ("doc_to_text", "{# c #}"),
    ("doc_to_text", "{{ context|e }}"), ("doc_to_choice", ["a", "{{ x.y }}"]), ("doc_to_target", True),
    ("process_results", "m.f"), ("class", "m.C"), ("description", "x"), ("metric_list", [{"metric": "./m.py"}]),
    ("metric_list", [{"metric": "acc", "aggregation": "m.f"}]), ("dataset_path", "./loader_dir"),
    ("dataset_kwargs", {"data_files": "x.jsonl", "trust_remote_code": True}), ("output_type", "custom"),
    ("generation_kwargs", {"until": ["\n"], "logits_processor": "m.f"}), ("metadata", {"version": {"a": 1}}),
])
def test_keys_and_values_outside_the_shipped_shapes_are_refused_naming_the_key(capsys, tmp_path, key, value):
    task = _write(tmp_path / "t.yaml", {"task": "t_bad", **_base(tmp_path), key: value})
    assert_one_line_error(cli_inprocess(capsys, "eval", "--model", "a", "--tasks", task, "--root", tmp_path),
                          str(task), repr(key))


@pytest.mark.parametrize("text", ["context", "", "Q: {{ context }}\nA:", "{{context}} and {{ target }}",
                                  "a { b } {{ c }} }} {", "def f():\n    return {'a': 1}"])
def test_plain_templates_are_accepted(tmp_path, text):
    task = _write(tmp_path / "t.yaml", {"task": "t_ok", **_base(tmp_path, doc_to_text=text)})
    assert taskdata.load(task)["doc_to_text"] == text


def test_includes_resolve_relative_to_the_including_file_with_no_cycles(tmp_path):
    sub = tmp_path / "sub"
    sub.mkdir()
    _write(sub / "base.yaml", {**_base(tmp_path), "task": "base_name", "doc_to_text": "base"})
    _write(sub / "mid.yaml", {"include": "base.yaml", "doc_to_text": "mid"})
    top = _write(tmp_path / "top.yaml", {"include": "sub/mid.yaml", "task": "top_name"})
    (got,) = resolve(str(top))
    doc = __import__("yaml").safe_load(got.yaml_text)
    assert "include" not in doc   # the harness follows nothing: it gets one resolved task
    assert doc["task"] == "top_name" and doc["doc_to_text"] == "mid" and doc["dataset_path"] == "json"
    _write(sub / "base.yaml", {"include": "../top.yaml"})
    with pytest.raises(Exception, match="include cycle"):
        resolve(str(top))


def test_every_shipped_task_passes_the_data_checks():
    for name in shipped():
        assert taskdata.load(TASKS_DIR / f"{name}.yaml")["task"] == name


@pytest.mark.lmeval
@pytest.mark.timeout(900)
def test_an_included_task_of_allowed_keys_runs_through_the_real_harness(capsys, model, tmp_path):
    _write(tmp_path / "base.yaml", _base(tmp_path))
    task = _write(tmp_path / "t.yaml", {"include": "base.yaml", "task": "t_ok_inc",
                                        "doc_to_text": "Q: {{ context }}"})
    proc = _eval(capsys, model, tmp_path, task)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((tmp_path / "storage" / "logs" / model.name / "eval.jsonl").read_text().splitlines()[-1])
    assert rec["tasks"]["t_ok_inc"]["n"] == 2 and rec["tasks"]["t_ok_inc"]["metrics"]["perplexity"] > 1


@pytest.mark.lmeval
@pytest.mark.timeout(900)
def test_an_unknown_harness_task_is_one_line_before_anything_starts(capsys, tmp_path):
    """Checked against the harness's own index (cached per install): exit 2 naming it, before the model is even
    looked for; a name it knows passes the check (and the missing model is what is said then)."""
    import time

    args = ["eval", "--model", "nope", "--root", tmp_path, "--tasks"]
    assert_one_line_error(cli_inprocess(capsys, *args, "llmc_stdlib_mc,no_such_task_xyz"), "no_such_task_xyz",
                          "not a shipped task")
    t0 = time.monotonic()
    assert_one_line_error(cli_inprocess(capsys, *args, "arc_easy"), "no exported model")
    assert time.monotonic() - t0 < 30   # the index is read from its cache: no harness start-up
