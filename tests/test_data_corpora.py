"""Real corpora: every record format becomes one document per record with the tokenizer's own token count;
an HF tokenizer's BOS/EOS delimit documents; sliced prepare + merge equals one pass."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, cli_inprocess
from hf_helpers import CORPUS, make_hf_tokenizer

pytestmark = pytest.mark.timeout(300)


def _records(n: int, offset: int = 0) -> list[dict]:
    return [{"id": i, "text": CORPUS[(i + offset) % len(CORPUS)] + f"#{i + offset}"} for i in range(n)]


def _write(fmt: str, path: Path, recs: list[dict], field: str = "text") -> Path:
    rows = [{"id": r["id"], field: r["text"]} for r in recs]
    if fmt.startswith("jsonl"):
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        if fmt == "jsonl.gz":
            data = gzip.compress(data)
        elif fmt == "jsonl.zst":
            import zstandard
            data = zstandard.ZstdCompressor().compress(data)
        path = path.with_name(path.name + "." + fmt)
        path.write_bytes(data)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        path = path.with_name(path.name + ".parquet")
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    else:  # a saved HF `datasets` directory, in several Arrow files
        import datasets
        datasets.Dataset.from_list(rows).save_to_disk(str(path), num_shards=3)
    return path


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory) -> Path:
    return make_hf_tokenizer(tmp_path_factory.mktemp("tok") / "hf")


def _tokens(root: Path, name: str, split: str = "train") -> np.ndarray:
    d = root / "datasets" / "text" / name
    meta = json.loads((d / "meta.json").read_text())
    parts = [np.fromfile(d / s["file"], dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
             for s in meta["shards"][split]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "datasets"])
def test_each_record_is_one_document_with_the_tokenizers_count(capsys, tmp_path, hf_tok, fmt):
    from tokenizers import Tokenizer

    recs = _records(53)
    src = _write(fmt, tmp_path / "corpus", recs, field="body")
    root = tmp_path / "s"
    proc = cli_inprocess(capsys, "data", "prepare", "--root", root, "--name", "c", "--kind", "text",
                         "--source", src, "--text-field", "body", "--tokenizer", hf_tok,
                         "--val-fraction", "0", "--shard-tokens", "1024")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((root / "datasets/text/c/meta.json").read_text())
    assert meta["documents"] == {"train": 53, "val": 0}
    assert (meta["bos_id"], meta["eot_id"]) == (0, 1)  # <s>, </s> as tokenizer_config.json names them
    tok = Tokenizer.from_file(str(hf_tok / "tokenizer.json"))
    want = [0, *(i for r in recs for i in [*tok.encode(r["text"], add_special_tokens=False).ids, 1, 0])][:-1]
    got = _tokens(root, "c")
    assert meta["tokens"]["train"] == len(want) == len(got)
    assert got.tolist() == want  # record order, [BOS] text [EOS] each
    assert (root / "datasets/text/c/tokenizer_config.json").is_file()


def test_missing_text_field_is_one_line(capsys, tmp_path):
    src = _write("jsonl", tmp_path / "c", _records(3))
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--source", src,
                                        "--tokenizer", "byte", "--text-field", "content"),
                          "no field 'content'", "--text-field")


def test_bad_json_line_is_one_line(capsys, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": broken\n')
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--root", tmp_path / "s", "--source", p,
                                        "--tokenizer", "byte"), "bad.jsonl:2: not a JSON record")


def _prepare(capsys, root, srcs, *extra):
    return cli_inprocess(capsys, "data", "prepare", "--root", root, "--name", "mix", "--kind", "text",
                         "--source", *srcs, "--tokenizer", "bpe:400", "--val-fraction", "0.2",
                         "--shard-tokens", "2048", "--tokenizer-sample-bytes", "20000", *extra)


def test_four_slices_merged_equal_one_pass_with_workers(capsys, tmp_path):
    srcs = [_write(fmt, tmp_path / f"part{i}", _records(40, offset=40 * i))
            for i, fmt in enumerate(["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "datasets"])]
    one = tmp_path / "one"
    assert _prepare(capsys, one, srcs).returncode == 0
    many = tmp_path / "many"
    for i in range(4):  # as a Slurm array job would, one slice per task (here with 2 worker processes)
        proc = _prepare(capsys, many, srcs, "--shard", f"{i}/4", "--workers", "2")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("slice ")
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--root", many, "--name", "mix", "--kind",
                                        "text", "--source", *srcs, "--tokenizer", "byte", "--shard", "4/4"),
                          "--shard 4/4")
    proc = cli_inprocess(capsys, "data", "merge", "--root", many, "--name", "mix", "--kind", "text")
    assert proc.returncode == 0, proc.stderr
    a, b = (json.loads((r / "datasets/text/mix/meta.json").read_text()) for r in (one, many))
    for k in ("tokens", "documents", "shards", "vocab_size", "files", "bytes"):
        assert a[k] == b[k], k  # shard checksums included: the same bytes
    assert a["documents"]["train"] + a["documents"]["val"] == 200
    assert (one / "datasets/text/mix/tokenizer.json").read_bytes() == \
        (many / "datasets/text/mix/tokenizer.json").read_bytes()
    assert not (many / "scratch" / "data-mix").exists()
    assert cli_inprocess(capsys, "data", "verify", "--root", many, "--name", "mix", "--kind", "text").returncode == 0


def test_merge_refuses_missing_slice(capsys, tmp_path):
    srcs = [_write("jsonl", tmp_path / f"p{i}", _records(5, 5 * i)) for i in range(3)]
    root = tmp_path / "s"
    for i in (0, 2):
        assert cli_inprocess(capsys, "data", "prepare", "--root", root, "--name", "m", "--source", *srcs,
                             "--tokenizer", "byte", "--shard", f"{i}/3").returncode == 0
    assert_one_line_error(cli_inprocess(capsys, "data", "merge", "--root", root, "--name", "m"),
                          "1 of 3 missing", "1/3")


def test_merging_one_kind_keeps_the_other_kinds_slices(capsys, tmp_path):
    """scratch/data-<name>/ holds the slices of every kind of that name: merging `text` must not delete the
    `code` slices (hours of tokenization), which stay mergeable."""
    srcs = [_write("jsonl", tmp_path / f"p{i}", _records(6, 6 * i)) for i in range(2)]
    root = tmp_path / "s"
    for kind in ("text", "code"):
        for i in range(2):
            assert cli_inprocess(capsys, "data", "prepare", "--root", root, "--name", "m", "--kind", kind,
                                 "--source", *srcs, "--tokenizer", "byte", "--val-fraction", "0",
                                 "--shard", f"{i}/2").returncode == 0
    scratch = root / "scratch" / "data-m"
    code_slices = sorted(p.name for p in (scratch / "code").iterdir())
    assert len(code_slices) == 2
    proc = cli_inprocess(capsys, "data", "merge", "--root", root, "--name", "m", "--kind", "text")
    assert proc.returncode == 0, proc.stderr
    assert not (scratch / "text").exists()
    assert sorted(p.name for p in (scratch / "code").iterdir()) == code_slices
    proc = cli_inprocess(capsys, "data", "merge", "--root", root, "--name", "m", "--kind", "code")
    assert proc.returncode == 0, proc.stderr
    assert not scratch.exists()  # the last kind merged: the name's scratch directory goes too
    for kind in ("text", "code"):
        meta = json.loads((root / "datasets" / kind / "m" / "meta.json").read_text())
        assert meta["documents"]["train"] == 12 and meta["merged_slices"] == 2
        assert cli_inprocess(capsys, "data", "verify", "--root", root, "--name", "m", "--kind",
                             kind).returncode == 0


def test_directory_walk_reads_record_files_and_saved_datasets(capsys, tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    _write("jsonl.gz", d / "a", _records(4))
    _write("datasets", d / "b_saved", _records(5, 10))
    (d / "c.jsonl").write_text('{"text": "one"}\n{"text": null}\n{"text": "   "}\n\n{"text": "two"}\n')
    root = tmp_path / "s"
    proc = cli_inprocess(capsys, "data", "prepare", "--root", root, "--name", "d", "--kind", "text",
                         "--source", d, "--tokenizer", "byte", "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((root / "datasets/text/d/meta.json").read_text())
    assert meta["documents"]["train"] == 4 + 5 + 2  # null and whitespace-only records are skipped


def test_bos_only_where_the_tokenizer_adds_it(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from llmcluster.data.tokenizer import load_tokenizer

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.add_special_tokens(["<|endoftext|>"])
    d = tmp_path / "gpt2ish"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))  # no post-processor: nothing prepended
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>",
                                                         "eos_token": "<|endoftext|>"}))
    dt = load_tokenizer(d)
    assert dt.bos_id is None and dt.eos_id == tok.token_to_id("<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>", "add_bos_token": True,
                                                         "eos_token": "<|endoftext|>"}))
    assert load_tokenizer(d).bos_id == dt.eos_id
