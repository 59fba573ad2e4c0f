"""Where documents come from: plain files (one document each) and record corpora (one document per record).

Record formats, by name: `.jsonl`, `.jsonl.gz`, `.jsonl.zst`, `.parquet`, and a directory saved by HF
`datasets` (`save_to_disk`: state.json + Arrow files, or a DatasetDict of them). Every reader streams - a line,
a record batch at a time - so memory stays bounded whatever the corpus size.

A source is cut into *units* (a file, a parquet file, one Arrow file of a saved dataset). Units are the grain of
`--shard I/N`: slice I takes a contiguous run of units, so the slices concatenated in order are exactly the
one-pass document stream. Each document carries a stable key (`unit#record`) that decides its train/val split,
so the split does not depend on how the corpus was sliced.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmcluster.errors import UserError

CODE_SUFFIXES = {".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".js", ".ts", ".java",
                 ".sh", ".toml", ".yaml", ".yml", ".json", ".md", ".rst", ".txt"}
RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
SKIP_DIRS = {"site-packages", "__pycache__", ".git", "test", "tests", "idle_test", "node_modules"}
READ_BATCH = 1024  # parquet/arrow rows per record batch: bounded memory, few Python round trips
MAX_RECORD_BYTES = 64 * 2**20  # one document (a record, a plain file): larger is refused (--max-record-bytes)


@dataclass(frozen=True)
class Unit:
    path: Path
    fmt: str  # "file" | "jsonl" | "parquet" | "arrow"


def record_format(p: Path) -> str | None:
    name = p.name
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def _plain_name(value, p: Path, what: str) -> str:
    """A name a `datasets` directory lists (a split, an Arrow file) as one plain component of `p`: `.`, `..`,
    a path or an absolute name would read outside it, or recurse into it forever."""
    if not isinstance(value, str) or value in ("", ".", "..") or "/" in value or "\\" in value or "\0" in value:
        raise UserError(f"--source {p}: {what} {str(value)[:80]!r} is not a plain file or directory name")
    return value


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--source {path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UserError(f"--source {path}: not a JSON object")
    return doc


def _saved_dataset_units(p: Path, split: bool = False) -> list[Unit]:
    """The Arrow files of a `save_to_disk` directory, in its own order (a DatasetDict: split by split).
    A DatasetDict's splits are Datasets (state.json): never another DatasetDict, so nothing recurses."""
    if not split and (p / "dataset_dict.json").is_file():
        splits = _read_json(p / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list):
            raise UserError(f"--source {p}: dataset_dict.json 'splits' is not a list")
        names = [_plain_name(s, p, "dataset_dict.json split") for s in splits]
        for s in names:
            if not (p / s / "state.json").is_file():
                raise UserError(f"--source {p}: dataset_dict.json split {s!r} has no state.json")
        return [u for s in names for u in _saved_dataset_units(p / s, split=True)]
    try:
        files = [f["filename"] for f in _read_json(p / "state.json")["_data_files"]]
    except (KeyError, TypeError) as e:
        raise UserError(f"--source {p}: not a readable `datasets` directory (state.json: {e})") from None
    return [Unit(p / _plain_name(f, p, "state.json file"), "arrow") for f in files]


def collect_units(sources: list[Path], kind: str, skip_dirs: set[str] = SKIP_DIRS) -> list[Unit]:
    """Every unit under `sources`, sorted within each directory walk; record files become record units."""
    units: list[Unit] = []
    for src in sources:
        if is_saved_dataset(src):
            units += _saved_dataset_units(src)
        elif src.is_file():
            units.append(Unit(src, record_format(src) or "file"))
        elif src.is_dir():
            for dirpath, dirnames, names in os.walk(src):
                dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
                for d in list(dirnames):
                    if is_saved_dataset(Path(dirpath) / d):
                        dirnames.remove(d)
                        units += _saved_dataset_units(Path(dirpath) / d)
                for n in sorted(names):
                    p = Path(dirpath) / n
                    fmt = record_format(p)
                    if fmt:
                        units.append(Unit(p, fmt))
                    elif kind != "code" or p.suffix in CODE_SUFFIXES:
                        units.append(Unit(p, "file"))
        else:
            raise UserError(f"--source {src}: no such file or directory")
    seen, out = set(), []
    for u in units:  # the same file named twice is read once
        if u.path not in seen:
            seen.add(u.path)
            out.append(u)
    if not out:
        raise UserError(f"no {kind} files found under {', '.join(map(str, sources))}")
    return out


def shard_slice(units: list[Unit], shard: tuple[int, int] | None) -> list[Unit]:
    """Slice I of N: a contiguous run of units (so slices concatenated in order = the one-pass stream)."""
    if shard is None:
        return units
    i, n = shard
    if n > len(units):
        raise UserError(f"--shard {i}/{n}: the sources hold only {len(units)} files; use N <= {len(units)}")
    lo, hi = len(units) * i // n, len(units) * (i + 1) // n
    return units[lo:hi]


def _open_binary(p: Path):
    if p.name.endswith(".gz"):
        return gzip.open(p, "rb")
    if p.name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(p, "rb"), closefd=True))
    return open(p, "rb")


def _too_big(where: str, limit: int) -> UserError:
    return UserError(f"{where}: a record of more than {limit:,} bytes (--max-record-bytes); refused")


def _lines(p: Path, limit: int) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line, none longer than `limit` bytes: a line is read at most limit + 1
    bytes at a time, so one endless line is refused, not read into memory whole."""
    with _open_binary(p) as f:
        n = 0
        while line := f.readline(limit + 1):
            n += 1
            body = line[:-1] if line.endswith(b"\n") else line
            if len(body) > limit:
                raise _too_big(f"{p}:{n}", limit)
            yield n, body.decode("utf-8")


def _field(rec, field: str, where: str):
    if not isinstance(rec, dict) or field not in rec:
        keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
        raise UserError(f"{where}: no field {field!r} (has: {keys}); set --text-field")
    return rec[field]


def _jsonl_records(u: Unit, field: str, limit: int) -> Iterator[object]:
    try:
        for n, line in _lines(u.path, limit):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as e:   # RecursionError: nesting deeper than the parser goes
                raise UserError(f"{u.path}:{n}: not a JSON record ({e})") from None
            yield _field(rec, field, f"{u.path}:{n}")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise UserError(f"{u.path}: cannot read ({str(e).splitlines()[0] if str(e) else type(e).__name__})") \
            from None


def _arrow_batches(u: Unit, field: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if u.fmt == "parquet":
            pf = pq.ParquetFile(u.path)
            if field not in pf.schema_arrow.names:
                raise UserError(f"{u.path}: no column {field!r} (has: {', '.join(pf.schema_arrow.names)}); "
                                "set --text-field")
            yield from pf.iter_batches(batch_size=READ_BATCH, columns=[field])
            return
        with pa.memory_map(str(u.path)) as src:
            try:
                reader = pa.ipc.open_stream(src)  # what `datasets` writes
            except pa.ArrowInvalid:
                src.seek(0)
                reader = pa.ipc.open_file(src)
                reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
            for batch in reader:
                if field not in batch.schema.names:
                    raise UserError(f"{u.path}: no column {field!r} (has: {', '.join(batch.schema.names)}); "
                                    "set --text-field")
                yield batch.select([field])
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{u.path}: cannot read ({str(e).splitlines()[0]})") from None


def _check_batch(u: Unit, batch, first: int, limit: int) -> None:
    """A text column's values no longer than `limit` bytes (Arrow knows each length without a copy)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = batch.column(0)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)) or not len(col):
        return
    lengths = pc.binary_length(col)
    if (pc.max(lengths).as_py() or 0) > limit:
        i = next(i for i, n in enumerate(lengths.to_pylist()) if n is not None and n > limit)
        raise _too_big(f"{u.path} record {first + i}", limit)


def unit_records(u: Unit, field: str, limit: int = MAX_RECORD_BYTES) -> Iterator[object]:
    """The `field` value of every record of a record unit, in order (None for a null); a record over `limit`
    bytes is refused (one line naming file and line/record) before it is decoded into Python."""
    if u.fmt == "jsonl":
        yield from _jsonl_records(u, field, limit)
        return
    n = 0
    for batch in _arrow_batches(u, field):
        _check_batch(u, batch, n, limit)
        n += batch.num_rows
        yield from batch.column(0).to_pylist()


def _read_file(u: Unit, limit: int) -> str | None:
    """A plain file's text (universal newlines, as text mode reads it); None when it is not UTF-8 text
    (skipped, whatever its size). At most limit + 1 bytes are read: a larger text file is refused."""
    try:
        with open(u.path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return None
    try:   # incremental: a character cut at the limit is not a decoding error
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=len(data) <= limit)
    except UnicodeDecodeError:
        return None
    if len(data) > limit:
        raise _too_big(str(u.path), limit)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def iter_documents(units: list[Unit], field: str = "text", chat: bool = False,
                   limit: int = MAX_RECORD_BYTES) -> Iterator[tuple[str, object]]:
    """(key, text) for every non-empty document; plain files that are not UTF-8 are skipped (not text).
    chat: (key, messages) for every record, its field a list of {role, content} (checked by chat.py).
    A document (file or record) over `limit` bytes is refused: one line, not a MemoryError."""
    for u in units:
        if chat:
            if u.fmt == "file":
                raise UserError(f"{u.path}: --format chat reads record corpora (.jsonl, .parquet, ...), "
                                "not plain files")
            for i, messages in enumerate(unit_records(u, field, limit)):
                if messages is not None:
                    yield f"{u.path}#{i}", messages
            continue
        if u.fmt == "file":
            text = _read_file(u, limit)
            if text and text.strip():
                yield str(u.path), text
            continue
        for i, text in enumerate(unit_records(u, field, limit)):
            if text is None:
                continue
            if not isinstance(text, str):
                raise UserError(f"{u.path} record {i}: field {field!r} is {type(text).__name__}, not text")
            if text.strip():
                yield f"{u.path}#{i}", text
