"""Hostile corpora and tokenizers, through `data prepare`: every one is one line and exit 2, in bounded memory.

- a 1 GiB `.jsonl` line (a sparse file: the holes read as NUL bytes, nothing is stored) under a 1 GiB
  address-space limit (main read it whole: MemoryError traceback): refused naming file and line after reading
  --max-record-bytes (64 MiB) of it;
- a chat template whose output grows without end (nested loops, repetition, powers): refused naming the record;
- `dataset_dict.json` splits and `state.json` files that are not plain names (`.` used to recurse forever).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_one_line_error, cli_env, cli_inprocess
from hf_helpers import make_hf_tokenizer

GiB = 2**30
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.slow   # a subprocess reading 64 MiB of the line
def test_a_1gib_jsonl_line_is_one_line_in_bounded_memory(tmp_path):
    src = tmp_path / "huge.jsonl"
    with open(src, "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "')
        f.truncate(f.tell() + GiB)          # a hole: the line goes on for 1 GiB, no block is written
    assert src.stat().st_blocks * 512 < 2**20

    def limit_memory():   # no more address space than the line itself: read whole, it is a MemoryError
        resource.setrlimit(resource.RLIMIT_AS, (GiB, GiB))

    proc = subprocess.run([sys.executable, "-m", "llmcluster", "data", "prepare", "--root", tmp_path / "s",
                           "--kind", "text", "--source", src, "--tokenizer", "byte"],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=limit_memory)
    assert_one_line_error(proc, f"{src}:2", "67,108,864 bytes", "--max-record-bytes")
    assert not (tmp_path / "s" / "datasets" / "text").exists() or \
        not any((tmp_path / "s" / "datasets" / "text").iterdir())


@pytest.mark.parametrize("fmt", ["jsonl.gz", "parquet", "file"])
def test_record_over_max_record_bytes_names_file_and_record(capsys, tmp_path, fmt):
    rows = [{"text": "short"}, {"text": "x" * 5000}]
    if fmt == "jsonl.gz":
        import gzip
        src = tmp_path / "c.jsonl.gz"
        src.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
        where = f"{src}:2"
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        src = tmp_path / "c.parquet"
        pq.write_table(pa.Table.from_pylist(rows), src)
        where = f"{src} record 1"
    else:
        src = tmp_path / "big.txt"
        src.write_text("y" * 5000)
        where = str(src)
    args = ["data", "prepare", "--root", tmp_path / "s", "--kind", "text", "--source", src, "--tokenizer", "byte"]
    assert_one_line_error(cli_inprocess(capsys, *args, "--max-record-bytes", "4096"), where, "4,096 bytes")
    assert cli_inprocess(capsys, *args, "--max-record-bytes", "6000", "--val-fraction", "0").returncode == 0


def test_big_binary_file_in_a_walked_tree_is_still_skipped(capsys, tmp_path):
    d = tmp_path / "tree"
    d.mkdir()
    (d / "a.txt").write_text("some text here\n")
    (d / "blob.txt").write_bytes(b"\xff\xfe" * 5000)     # not UTF-8: not text, whatever its size
    proc = cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--kind", "text", "--source", d,
                         "--tokenizer", "byte", "--val-fraction", "0", "--max-record-bytes", "4096")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "s/datasets/text/stdlib/meta.json").read_text())["documents"]["train"] == 1


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> Path:
    return make_hf_tokenizer(tmp_path_factory.mktemp("tok") / "hf")


@pytest.mark.parametrize("template,why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ messages[0]['content'] }}{% endfor %}"
     "{% endfor %}", "rendered more than 1,000,000 bytes"),
    ("{{ messages[0]['content'] * 10**12 }}", "repetition"),
    ("{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "concatenation"),
    ("{{ 9 ** (10 ** 9) }}", "power"),
    ("{{ messages[0]['content'].ljust(10**12) }}", "unsafe"),
])
def test_chat_template_output_is_capped(capsys, tmp_path, hf_tok, template, why):
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in hf_tok.iterdir():
        (tok / f.name).write_bytes(f.read_bytes())
    conf = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": template}))
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps(CHAT) + "\n")
    proc = cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--format", "chat", "--source", src,
                         "--tokenizer", tok, "--max-record-bytes", "1000000")
    assert_one_line_error(proc, f"{src}#0", why)


def _saved(tmp_path: Path, splits) -> Path:
    import datasets

    d = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a document"}] * 3)}).save_to_disk(str(d))
    (d / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    return d


@pytest.mark.parametrize("split", [".", "..", "/etc", "train/../..", "", 7])
def test_dataset_dict_split_must_be_a_plain_name(capsys, tmp_path, split):
    d = _saved(tmp_path, ["train", split])
    proc = cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--kind", "text", "--source", d,
                         "--tokenizer", "byte")
    assert_one_line_error(proc, str(d), "dataset_dict.json split", "not a plain")


def test_dataset_dict_split_is_a_dataset_not_another_dict(capsys, tmp_path):
    d = _saved(tmp_path, ["train", "again"])
    (d / "again").symlink_to(d)                  # a split that is the dict itself: would recurse forever
    proc = cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--kind", "text", "--source", d,
                         "--tokenizer", "byte")
    assert_one_line_error(proc, "'again' has no state.json")


@pytest.mark.parametrize("name", ["../outside.arrow", "/etc/passwd", ".", None])
def test_state_json_files_must_be_plain_names(capsys, tmp_path, name):
    d = _saved(tmp_path, ["train"])
    state = json.loads((d / "train" / "state.json").read_text())
    state["_data_files"][0]["filename"] = name
    (d / "train" / "state.json").write_text(json.dumps(state))
    proc = cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--kind", "text", "--source", d,
                         "--tokenizer", "byte")
    assert_one_line_error(proc, "state.json file", "not a plain")
