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


def _saved_dataset_units(p: Path) -> list[Unit]:
    """The Arrow files of a `save_to_disk` directory, in its own order (a DatasetDict: split by split)."""
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        return [u for s in splits for u in _saved_dataset_units(p / s)]
    try:
        files = [f["filename"] for f in json.loads((p / "state.json").read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--source {p}: not a readable `datasets` directory (state.json: {e})") from None
    return [Unit(p / f, "arrow") for f in files]


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


def _open_text_lines(p: Path) -> Iterator[str]:
    if p.name.endswith(".gz"):
        f = gzip.open(p, "rt", encoding="utf-8")
    elif p.name.endswith(".zst"):
        import zstandard

        raw = open(p, "rb")
        f = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8")
    else:
        f = open(p, encoding="utf-8")
    with f:
        yield from f


def _field(rec, field: str, where: str):
    if not isinstance(rec, dict) or field not in rec:
        keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
        raise UserError(f"{where}: no field {field!r} (has: {keys}); set --text-field")
    return rec[field]


def _jsonl_records(u: Unit, field: str) -> Iterator[object]:
    try:
        for n, line in enumerate(_open_text_lines(u.path), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
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


def unit_records(u: Unit, field: str) -> Iterator[object]:
    """The `field` value of every record of a record unit, in order (None for a null)."""
    if u.fmt == "jsonl":
        yield from _jsonl_records(u, field)
        return
    for batch in _arrow_batches(u, field):
        yield from batch.column(0).to_pylist()


def iter_documents(units: list[Unit], field: str = "text", chat: bool = False) -> Iterator[tuple[str, object]]:
    """(key, text) for every non-empty document; plain files that are not UTF-8 are skipped (not text).
    chat: (key, messages) for every record, its field a list of {role, content} (checked by chat.py)."""
    for u in units:
        if chat:
            if u.fmt == "file":
                raise UserError(f"{u.path}: --format chat reads record corpora (.jsonl, .parquet, ...), "
                                "not plain files")
            for i, messages in enumerate(unit_records(u, field)):
                if messages is not None:
                    yield f"{u.path}#{i}", messages
            continue
        if u.fmt == "file":
            try:
                text = u.path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                yield str(u.path), text
            continue
        for i, text in enumerate(unit_records(u, field)):
            if text is None:
                continue
            if not isinstance(text, str):
                raise UserError(f"{u.path} record {i}: field {field!r} is {type(text).__name__}, not text")
            if text.strip():
                yield f"{u.path}#{i}", text
