"""Tokenizers and token shards: exact round trips, checksums, and refusing damaged data."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_one_line_error, cli_inprocess, resize_disk, small_disk
from llmcluster.data.tokenizer import EOT, byte_tokenizer, train_bpe

SAMPLES = [
    "def f(x):\n\treturn x ** 2  # square\n",
    "    indented\n\n\n  trailing spaces   \n",
    "unicode: héllo wörld — 日本語 🚀\r\nwindows line",
    "",
    "<|endoftext|> is only special when added as a token",
]


@pytest.mark.parametrize("make", [byte_tokenizer, lambda: train_bpe(SAMPLES * 50, 300)])
def test_round_trip_is_exact(make):
    tok = make()
    for text in SAMPLES:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id(EOT) is not None


def test_prepare_writes_shards_meta_and_checksums(tiny_root: Path):
    ds = tiny_root / "datasets" / "code" / "tiny"
    meta = json.loads((ds / "meta.json").read_text())
    assert meta["vocab_size"] == 257 and meta["dtype"] == "uint16"
    assert meta["tokens"]["train"] > 10_000 and meta["tokens"]["val"] > 0
    from llmcluster.storage.layout import sha256_file

    for split in ("train", "val"):
        total = 0
        for shard in meta["shards"][split]:
            f = ds / shard["file"]
            assert sha256_file(f) == shard["sha256"]
            arr = np.fromfile(f, dtype="<u2")
            assert len(arr) == shard["tokens"] and arr.max() < 257
            total += len(arr)
        assert total == meta["tokens"][split]
    # Every document ends with EOT, and the bytes decode back to the sources.
    tok = byte_tokenizer()
    first = np.fromfile(ds / meta["shards"]["train"][0]["file"], dtype="<u2")
    eot = meta["eot_id"]
    doc = first[: int(np.argmax(first == eot))].tolist()
    text = tok.decode(doc)
    assert len(text) > 0 and any(text == Path(s).read_text() for s in _json_sources())


def _json_sources():
    import sysconfig
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").rglob("*.py"))


def _copy_dataset(tiny_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "s"
    shutil.copytree(tiny_root, root)
    return root


def test_truncated_shard_is_refused(capsys, tiny_root, tmp_path):
    root = _copy_dataset(tiny_root, tmp_path)
    shard = root / "datasets/code/tiny/train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-3])
    assert_one_line_error(cli_inprocess(capsys, "data", "verify", "--name", "tiny", "--root", root),
                          "train_000000.bin is truncated")


def test_corrupted_shard_is_refused(capsys, tiny_root, tmp_path):
    root = _copy_dataset(tiny_root, tmp_path)
    shard = root / "datasets/code/tiny/train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    assert_one_line_error(cli_inprocess(capsys, "data", "verify", "--name", "tiny", "--root", root),
                          "corrupt (sha256 mismatch)")


def test_out_of_vocab_tokens_are_refused(capsys, tiny_root, tmp_path):
    root = _copy_dataset(tiny_root, tmp_path)
    ds = root / "datasets/code/tiny"
    meta = json.loads((ds / "meta.json").read_text())
    arr = np.fromfile(ds / "val_000000.bin", dtype="<u2")
    arr[0] = 5000
    arr.tofile(ds / "val_000000.bin")
    from llmcluster.storage.layout import sha256_file
    meta["shards"]["val"][0]["sha256"] = sha256_file(ds / "val_000000.bin")  # a well-formed lie
    (ds / "meta.json").write_text(json.dumps(meta))
    assert_one_line_error(cli_inprocess(capsys, "data", "verify", "--name", "tiny", "--root", root),
                          "outside the vocabulary")


def test_missing_dataset_and_existing_name(capsys, tiny_root, tmp_path):
    assert_one_line_error(cli_inprocess(capsys, "data", "verify", "--name", "nope", "--root", tiny_root),
                          "dataset not found")
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--name", "tiny", "--root", tiny_root,
                                        "--source", tmp_path, "--tokenizer", "byte"), "already exists")
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--name", "x", "--root", tiny_root,
                                        "--source", tmp_path / "missing"), "no such file")
    assert_one_line_error(cli_inprocess(capsys, "data", "prepare", "--name", "x", "--root", tiny_root,
                                        "--tokenizer", "bpe:abc"), "bpe:N")


def test_a_bad_dataset_name_is_called_a_dataset_name(capsys, storage, tmp_path):
    """A dataset is not a run: the refusal names what the user named (issue 34)."""
    proc = cli_inprocess(capsys, "data", "prepare", "--name", "my data", "--root", storage, "--source", tmp_path,
                         "--tokenizer", "byte")
    assert_one_line_error(proc, "invalid dataset name 'my data'")
    assert "run name" not in proc.stderr


def test_a_full_disk_is_one_line_and_keeps_the_existing_dataset(capsys, storage, tmp_path):
    """Issue 64: `data prepare` onto a full disk was a 21-line traceback. Now one line and its own exit code, the
    partial write removed, the dataset it was to replace (--force) bitwise as it was, and done once space is freed."""
    from llmcluster.errors import EXIT_DISK_FULL

    small, big = tmp_path / "small", tmp_path / "big"
    small.mkdir()
    big.mkdir()
    (small / "a.py").write_text("def f(x):\n    return x\n" * 100)
    rng = np.random.default_rng(0)   # ~1 MB of source: ~2 MB of uint16 byte tokens, 8 times the disk
    (big / "b.py").write_text("".join(chr(c) for c in rng.integers(97, 123, 1 << 20)))
    prepare = ("data", "prepare", "--name", "d", "--root", storage, "--tokenizer", "byte", "--source")
    with small_disk(storage / "datasets" / "code", "256k") as disk:
        assert cli_inprocess(capsys, *prepare, small).returncode == 0
        before = {p: p.read_bytes() for p in sorted((disk / "d").rglob("*")) if p.is_file()}
        proc = cli_inprocess(capsys, *prepare, big, "--force")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == EXIT_DISK_FULL and len(lines) == 1 and "Traceback" not in proc.stderr, proc
        assert "disk full writing dataset d" in lines[0] and f"the existing {disk / 'd'} is intact" in lines[0]
        assert [p.name for p in disk.iterdir()] == ["d"]      # no .tmp-d-*
        assert {p: p.read_bytes() for p in sorted((disk / "d").rglob("*")) if p.is_file()} == before
        resize_disk(disk, "16m")
        assert cli_inprocess(capsys, *prepare, big, "--force").returncode == 0


def test_sampler_is_deterministic_resumable_and_rank_partitioned(tiny_root):
    from llmcluster.data.dataset import Sampler, open_dataset

    ds = open_dataset(tiny_root, "tiny", verify=False)
    one = Sampler(ds, 32, seed=1)
    ref = [np.concatenate([ids for ids, _, _ in one.micro_batches(8, 0, 1, 8)]) for _ in range(5)]
    # two ranks × micro-batch 2 × accum 2 cover exactly the same 8 samples per step
    ranks = [Sampler(ds, 32, seed=1) for _ in range(2)]
    for step in range(5):
        got = np.concatenate([ids for r, s in enumerate(ranks) for ids, _, _ in s.micro_batches(8, r, 2, 2)])
        assert sorted(got.tolist()) == sorted(ref[step].tolist())
    # resume from state: continues with the same samples and tokens
    a, b = Sampler(ds, 32, seed=1), Sampler(ds, 32, seed=1)
    for _ in range(3):
        list(a.micro_batches(8, 0, 1, 8))
    b.load_state_dict(a.state_dict())
    (ia, xa, ya), (ib, xb, yb) = next(a.micro_batches(8, 0, 1, 8)), next(b.micro_batches(8, 0, 1, 8))
    assert (ia == ib).all() and (xa == xb).all() and (ya == yb).all()
    assert (xa[:, 1:] == ya[:, :-1]).all()  # targets are inputs shifted by one
