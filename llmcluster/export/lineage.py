"""A model's lineage (issue 67): lineage.json in every export, the chain from the export's files back to what made
them, each link with the digests that let anyone check it again later:

    export      every file of the export (README.md, the model card a person completes, and lineage.json aside)
    checkpoint  the run and step exported, and its COMPLETE.json's sha256 (which holds every checkpoint file's)
    run         the sha256 of the config the checkpoint was trained with, the run's fingerprint, its attempts
    datasets    each dataset's meta.json sha256 (its shard list and sizes), every shard's and the tokenizer's
    base        train.init_from (a LoRA/QLoRA or fine-tuning run's base): its path and every file's sha256

Why a file of its own and not the marker (llmcluster.json): the marker says that a directory is an export of ours and
is read by every command that replaces one; the lineage is a record of its own, larger (a digest per file) and
hashed by its readers: its own sha256 is the model's "lineage digest".

Written by export/hf.py (`build` + `write`); read by `llmcluster lineage` (cli/lineage.py) as data: JSON only, its
shape checked (storage/records.py), nothing executed. No torch here: an auditor checks a model on a machine without it
(docs/lineage.md). Paths inside the storage root are recorded relative to it, so a copied storage tree verifies
under `--root`; the base is recorded by its absolute path (it lives anywhere).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from llmcluster.errors import UserError
from llmcluster.storage import records
from llmcluster.storage.layout import COMPLETE_MARKER, check_marker, sha256_file
from llmcluster.storage.energy import run_energy

LINEAGE = "lineage.json"
LINEAGE_FORMAT = "llmcluster-lineage-v1"
CARD = "README.md"             # the model card: written after the lineage, completed by a person, so never hashed
UNHASHED = {LINEAGE, CARD}
LINKS = ("export", "checkpoint", "run", "datasets", "base")   # the chain's order: the first broken one is named
PROGRESS_BYTES = 256 << 20     # files larger than this are hashed with a progress line (a base takes minutes)

# lineage.json's shape, link by link (the record is data in a directory others may write: checked before use)
DIGESTS = records.of_type(dict, what="an object of file names to sha256 digests")
SHAPE = {
    "export": ({"files": DIGESTS}, {}),
    "checkpoint": ({"run": records.TEXT, "step": records.integer(0), "path": records.TEXT,
                    "complete_sha256": records.TEXT}, {}),
    "run": ({"name": records.TEXT, "config_sha256": records.TEXT, "fingerprint": records.OBJECT},
            {"attempts": records.integer(0), "wall_s": records.number(0), "device": records.TEXT,
             "world_size": records.integer(1), "energy_j": records.number(0), "job_config_sha256": records.TEXT, "dataset_digest": records.TEXT,
             "tokens_seen": records.integer(0), "parallel": records.TEXT, "precision": records.TEXT,
             "lora": records.OBJECT}),
    "dataset": ({"name": records.TEXT, "path": records.TEXT, "meta_sha256": records.TEXT,
                 "tokenizer_sha256": records.TEXT, "shards": DIGESTS},
                {"kind": records.TEXT, "tokens": records.OBJECT}),
    "base": ({"path": records.TEXT, "files": DIGESTS}, {"sha256": records.TEXT}),
}


def hash_file(path: Path, say: Callable[[str], None] | None = None) -> str:
    """sha256 of `path`; a large one says how far it is every few seconds through `say` (stderr by default)."""
    size = path.stat().st_size
    if size <= PROGRESS_BYTES:
        return sha256_file(path)
    say = say or _stderr
    h, done, last = hashlib.sha256(), 0, time.monotonic()
    with open(path, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
            done += len(b)
            if time.monotonic() - last > 5:
                last = time.monotonic()
                say(f"hashing {path}: {done / size:.0%} of {size / 1e9:.1f} GB")
    return h.hexdigest()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def files_of(d: Path, skip: set[str] = frozenset()) -> list[Path]:
    """The regular files under `d` (links not followed, hidden names left out), in name order."""
    out = [p for p in d.rglob("*") if p.is_file() and not p.is_symlink()
           and not any(part.startswith(".") for part in p.relative_to(d).parts)]
    return sorted(p for p in out if p.relative_to(d).as_posix() not in skip)


def digests(d: Path, skip: set[str] = frozenset(), say=None) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hash_file(p, say) for p in files_of(d, skip)}


def base_digest(files: dict[str, str]) -> str:
    """One sha256 for a base model directory: over its files' names and sha256s, in name order. Recorded with the
    base link (and in the card): what a served adapter's base can be checked by without listing every file."""
    return hashlib.sha256("".join(f"{n}:{d}\n" for n, d in sorted(files.items())).encode()).hexdigest()


def config_sha256(config: dict) -> str:
    """The digest of a run's resolved config as its checkpoint saved it (canonical JSON: sorted keys, no spaces):
    every run has one, launched or not (job.json's config_sha256 is the launched file's, when there was a launch)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _rel(path: Path, root: Path) -> str:
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(Path(path).resolve())


def _where(recorded: str, root: Path) -> Path:
    return Path(recorded) if Path(recorded).is_absolute() else Path(root) / recorded


# -- writing (export time) ---------------------------------------------------------------------------------------
def build(export_dir: Path, root: Path, run: str, ckpt: Path, state: dict, datasets: list[tuple[str, Path]],
          say=None) -> dict:
    """The lineage of the export being written in `export_dir` (its files all there but the card): `state` is
    the checkpoint's train_state.json, `datasets` the (name, directory) of every dataset the run read."""
    config = state.get("config") or {}
    train = config.get("train") or {}
    seq_len = (config.get("data") or {}).get("seq_len") or 0
    sampler = state.get("sampler") or {}
    consumed = sampler.get("consumed") if isinstance(sampler.get("consumed"), int) else None
    atts = run_attempts(root, run)
    run_rec = {"name": run, "config_sha256": config_sha256(config), "fingerprint": state.get("fingerprint") or {},
               "attempts": None if atts is None else len(atts),
               "wall_s": None if atts is None else round(sum(a[-1]["t"] - a[0]["t"] for a in atts), 3),
               "device": state.get("device"), "world_size": state.get("world_size"),
               "energy_j": (run_energy(Path(root) / "logs" / run) or {}).get("joules"),
               "job_config_sha256": _job_config_sha256(root, run),
               "dataset_digest": state.get("dataset_digest"),
               "tokens_seen": None if consumed is None else (consumed - int(state.get("ft_skipped_samples") or 0))
               * int(seq_len),
               "parallel": state.get("parallel"), "precision": train.get("precision"), "lora": train.get("lora")}
    rec = {"format": LINEAGE_FORMAT, "storage_root": str(Path(root).resolve()),   # where the relative paths were
           "export": {"files": digests(export_dir, UNHASHED, say)},
           "checkpoint": {"run": run, "step": int(state["step"]), "path": _rel(ckpt, root),
                          "complete_sha256": sha256_file(ckpt / COMPLETE_MARKER)},
           "run": run_rec,
           "datasets": [dataset_link(name, d, root, say) for name, d in datasets],
           "base": None}
    if train.get("init_from"):
        base = Path(train["init_from"]).resolve()
        if not base.is_dir():   # a LoRA checkpoint holds every weight: the export goes on, the gap is said
            (say or _stderr)(f"warning: export: train.init_from {base} is not here: the lineage records its path "
                             "and no digest (`lineage --verify` says it is not reachable)")
        files = digests(base, set(), say) if base.is_dir() else {}
        rec["base"] = {"path": str(base), "sha256": base_digest(files), "files": files}
    why = _trained_on(rec)
    if why:   # recorded as it is: `lineage --verify` names the same link
        (say or _stderr)(f"warning: export: {why[0]}: {why[1]}; the lineage records what is there now, and "
                         "`llmcluster lineage --verify` will say so")
    return rec


def dataset_link(name: str, d: Path, root: Path, say=None) -> dict:
    try:   # meta.json is the data team's record: read as data, its shard list checked for shape
        meta = json.loads((d / "meta.json").read_text())
        shards = {s["file"]: s["sha256"] for group in ("shards", "masks")
                  for split in (meta.get(group) or {}).values() for s in split}
        if not _digest_map(shards):
            raise ValueError("a shard's file or sha256 is not a string")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:   # every dataset recorded, or no export
        raise UserError(f"cannot record the lineage: dataset {name}: {d / 'meta.json'} is unreadable or not a "
                        f"dataset's ({getattr(e, 'strerror', None) or e})") from None
    return {"name": name, "kind": meta.get("kind"), "path": _rel(d, root), "meta_sha256": sha256_file(d / "meta.json"),
            "tokenizer_sha256": hash_file(d / "tokenizer.json", say), "shards": shards,
            "tokens": meta.get("tokens")}


def run_attempts(root: Path, run: str) -> list[list[dict]] | None:
    """The run's attempts as its events record them (`jobs goodput`'s: a no-op start is none); None: no events."""
    from llmcluster.storage.events import EVENTS, read_events, trained_attempts

    events = read_events(Path(root) / "logs" / run / EVENTS, warn=None)
    return trained_attempts(events) if events else None


def _job_config_sha256(root: Path, run: str) -> str | None:
    from llmcluster.storage.job_record import read_record

    rec = read_record(Path(root) / "logs" / run) or {}
    return rec.get("config_sha256")


def write(export_dir: Path, rec: dict) -> None:
    (export_dir / LINEAGE).write_text(json.dumps(rec, indent=1) + "\n")


# -- reading and verifying (any machine, no torch) ---------------------------------------------------------------
def read(export_dir: Path) -> dict:
    """An export's lineage.json, its shape checked: one line (UserError) when it is missing or not a record."""
    from llmcluster.storage.owned import read_text

    path = export_dir / LINEAGE
    text, why = read_text(path, own=False)
    if text is None:
        raise UserError(f"{path} {why}" if why else f"{export_dir} has no {LINEAGE} (exported before lineage "
                        "records existed, or not an llmcluster export): export it again")
    try:
        rec = records.loads(text)
    except (ValueError, RecursionError):
        raise UserError(f"{path} is not JSON") from None
    why = shape_problem(rec)
    if why:
        raise UserError(f"{path} is not a lineage record: {why}")
    return rec


def shape_problem(rec) -> str | None:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if rec.get("format") != LINEAGE_FORMAT:
        return f"'format' is not {LINEAGE_FORMAT!r}"
    def parts():   # the chain's order: the first link of a wrong shape is named
        yield from ((k, rec.get(k), SHAPE[k]) for k in ("export", "checkpoint", "run"))
        yield from ((f"datasets[{i}]", d, SHAPE["dataset"]) for i, d in enumerate(datasets))
        if rec.get("base") is not None:
            yield "base", rec["base"], SHAPE["base"]
    datasets = rec.get("datasets")
    if not isinstance(datasets, list):
        datasets = []
    for name, part, (required, optional) in parts():
        why = records.problem(part, required, optional)
        if why:
            return f"{name}: {why}"
        for key, value in part.items():   # every digest map: names to 64-hex strings
            if (required.get(key) or optional.get(key)) is DIGESTS and not _digest_map(value):
                return f"{name}: {key!r} is not an object of file names to sha256 digests"
    return None if isinstance(rec.get("datasets"), list) else "'datasets' is not a list"


def _digest_map(d: dict) -> bool:
    return all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in d.items())


def digest(export_dir: Path) -> str:
    """The lineage digest: lineage.json's sha256 (what a serving record can hold to name what it serves)."""
    return sha256_file(export_dir / LINEAGE)


def storage_root_for(export_dir: Path, rec: dict, given: str | Path | None) -> Path:
    """The storage root the record's relative paths are under: `given` (--root), else the one the export sits in
    (<root>/models/<name>), else the one it was exported from (an `export --out` elsewhere), else the default."""
    if given:
        return Path(given)
    if export_dir.parent.name == "models":
        return export_dir.parent.parent
    if isinstance(rec.get("storage_root"), str):
        return Path(rec["storage_root"])
    from llmcluster.config.cluster_load import storage_root

    return storage_root(None)


def served(export_dir: Path, require: bool) -> dict:
    """What a serving record holds of the export it serves (`serve start`): its lineage digest, and whether the chain
    was verified (`--require-lineage`: it must be, else one line and nothing starts). Without the flag, a model
    without a record (an export made before lineage records, anyone's HF model) is served as before, and one whose
    record is malformed too, with one note: the flag is what makes the lineage a condition."""
    if not (export_dir / LINEAGE).is_file():
        if require:
            raise UserError(f"--require-lineage: {export_dir} has no {LINEAGE} (not an export, or one made before "
                            "lineage records: export it again)")
        return {}
    try:
        rec = read(export_dir)
    except UserError as e:
        if require:
            raise UserError(f"--require-lineage: {e}") from None
        _stderr(f"note: {e}: the serving record names no lineage")
        return {}
    if require:
        try:
            verify(export_dir, rec, storage_root_for(export_dir, rec, None))
        except Broken as e:
            raise UserError(f"--require-lineage: {export_dir}: its lineage is broken at {e}") from None
    return {"lineage_sha256": digest(export_dir), "lineage_verified": require}


def endpoint_export(root: Path, name: str) -> tuple[Path, dict] | None:
    """The export a serving job (`jobs list`'s name) serves, and its job.json; None when `name` is no serving job.
    The record's paths are data: only strings are taken, and the directory must exist."""
    from llmcluster.storage.job_record import read_record
    from llmcluster.storage.layout import Storage, check_run_name

    job = read_record(Storage(Path(root)).run_logs(check_run_name(name, "model, run or endpoint")))
    if not job or job.get("kind") != "serve":
        return None
    where = job.get("adapter") if isinstance(job.get("adapter"), str) else job.get("model_dir")
    if not isinstance(where, str):
        raise UserError(f"serving job {name}: its job.json names no model directory")
    export = Path(where).parent if isinstance(job.get("adapter"), str) else Path(where)
    if not export.is_dir():
        raise UserError(f"serving job {name}: the export it served, {export}, is not here")
    return export, job


def check_endpoint(name: str, job: dict, export_dir: Path) -> tuple[str, str]:
    """The endpoint link: the lineage digest `serve start` recorded is the export's now."""
    link = f"endpoint {name}"
    recorded = job.get("lineage_sha256")
    if recorded is None:
        return link, "not recorded: started without a lineage digest (before lineage records, or an export without one)"
    if digest(export_dir) != recorded:
        raise Broken(link, f"{export_dir / LINEAGE} changed since `serve start` (recorded {recorded[:12]})")
    return link, "verified"


class Broken(Exception):
    """A link that no longer holds: its name and what changed (one line)."""

    def __init__(self, link: str, why: str):
        super().__init__(f"{link}: {why}")
        self.link = link


def _check_files(link: str, base: Path, recorded: dict[str, str], say, safe: bool = True) -> None:
    for rel, want in recorded.items():
        path = base / rel
        if safe and (Path(rel).is_absolute() or ".." in Path(rel).parts):
            raise Broken(link, f"names a file outside {base}: {rel!r}")
        if not path.is_file():
            raise Broken(link, f"{path} is missing")
        try:
            got = hash_file(path, say)
        except OSError as e:
            raise Broken(link, f"cannot read {path}: {e.strerror or e}") from None
        if got != want:
            raise Broken(link, f"{path} changed (sha256 {got[:12]}, recorded {want[:12]})")


def verify(export_dir: Path, rec: dict, root: Path, say=None) -> list[tuple[str, str]]:
    """Recompute every digest the record names that this machine can reach, link by link in the chain's order.
    Returns (link, "verified" | "not reachable here: ...") for each; raises Broken at the first that does not hold.
    A link whose directory is absent here (a pruned checkpoint, a dataset on another cluster) is not reachable,
    not broken; a file missing or changed in a directory that is here breaks it."""
    out: list[tuple[str, str]] = []
    # export: the files written are the files recorded, no more and no less
    have = {p.relative_to(export_dir).as_posix() for p in files_of(export_dir, UNHASHED)}
    extra = sorted(have - set(rec["export"]["files"]))
    if extra:
        raise Broken("export", f"{export_dir / extra[0]} is not in the record (added after the export)")
    _check_files("export", export_dir, rec["export"]["files"], say)
    out.append(("export", "verified"))

    ck = rec["checkpoint"]
    step_dir = _where(ck["path"], root)
    link = f"checkpoint {ck['run']} step_{ck['step']}"
    if not step_dir.is_dir():
        out.append((link, f"not reachable here: {step_dir} is absent (pruned, or another storage root: --root)"))
        train_state = None
    else:
        marker = step_dir / COMPLETE_MARKER
        if not marker.is_file():
            raise Broken(link, f"{marker} is missing")
        if sha256_file(marker) != ck["complete_sha256"]:
            raise Broken(link, f"{marker} changed since the export (the checkpoint was rewritten)")
        m = check_marker(step_dir)
        if isinstance(m, str):
            raise Broken(link, m)
        _check_files(link, step_dir, m["files"], say)
        out.append((link, "verified"))
        train_state = _train_state(step_dir, link)

    run = rec["run"]
    link = f"run {run['name']}"
    if train_state is None:
        out.append((link, "not reachable here: its checkpoint is not"))
    else:
        if config_sha256(train_state.get("config") or {}) != run["config_sha256"]:
            raise Broken(link, "the checkpoint's config is not the one recorded")
        if (train_state.get("fingerprint") or {}) != run["fingerprint"]:
            raise Broken(link, "the checkpoint's fingerprint is not the one recorded")
        out.append((link, "verified"))

    why = _trained_on(rec)
    if why:
        raise Broken(*why)
    for ds in rec["datasets"]:
        d = _where(ds["path"], root)
        link = f"dataset {ds['name']}"
        if not d.is_dir():
            out.append((link, f"not reachable here: {d} is absent"))
            continue
        _check_files(link, d, {"meta.json": ds["meta_sha256"], "tokenizer.json": ds["tokenizer_sha256"]}, say)
        _check_files(link, d, ds["shards"], say)
        out.append((link, "verified"))

    base = rec.get("base")
    if base is not None:
        d = Path(base["path"])
        link = f"base {d}"
        if base.get("sha256") not in (None, base_digest(base["files"])):
            raise Broken(link, "the record's base digest is not its files' (the record was edited)")
        if not d.is_dir():
            out.append((link, f"not reachable here: {d} is absent"))
        else:
            _check_files(link, d, base["files"], say)
            out.append((link, "verified"))
    return out


def _trained_on(rec: dict) -> tuple[str, str] | None:
    """(link, why) when the record's datasets or base are not those its run's train state says it trained on (the
    dataset digest, the tokenizer's and an NF4 base's in the fingerprint): a dataset rebuilt, or a base replaced,
    between training and export. None when they agree, or when the run recorded nothing to compare with."""
    from llmcluster.checkpoint.fingerprint import dataset_digest, weights_digest

    run, fp = rec["run"], rec["run"]["fingerprint"]
    names = ", ".join(d["name"] for d in rec["datasets"])
    if rec["datasets"] and isinstance(run.get("dataset_digest"), str) and \
            dataset_digest([d["meta_sha256"] for d in rec["datasets"]]) != run["dataset_digest"]:
        return f"dataset {names}", "not the data the run trained on (its meta.json was rebuilt since: the run's " \
                                   f"train state says {run['dataset_digest'][:12]})"
    if rec["datasets"] and isinstance(fp.get("tokenizer"), str) and \
            not rec["datasets"][0]["tokenizer_sha256"].startswith(fp["tokenizer"]):
        return f"dataset {rec['datasets'][0]['name']}", "its tokenizer.json is not the one the run trained with"
    base = rec.get("base")
    if base is not None and isinstance(fp.get("base_weights"), str) and weights_digest(base["files"]) != fp["base_weights"]:
        return f"base {base['path']}", "its weights are not those the run trained on (the fingerprint's base_weights)"
    return None


def _train_state(step_dir: Path, link: str) -> dict:
    try:
        state = records.loads((step_dir / "train_state.json").read_text())
    except (OSError, ValueError, RecursionError):
        raise Broken(link, "its train_state.json is unreadable or not JSON") from None
    if not isinstance(state, dict):
        raise Broken(link, "its train_state.json is not an object")
    return state


def describe(rec: dict) -> list[str]:
    """The chain as lines, endpoint side first (`llmcluster lineage` without --verify)."""
    ck, run = rec["checkpoint"], rec["run"]
    lines = [f"export      {len(rec['export']['files'])} files",
             f"checkpoint  {ck['run']} step_{ck['step']} ({ck['path']}), {COMPLETE_MARKER} {ck['complete_sha256'][:16]}",
             f"run         {run['name']}: config {run['config_sha256'][:16]}"
             + (f", {run['attempts']} attempt(s)" if run.get("attempts") is not None else "")
             + (f", {run['tokens_seen']:,} tokens seen" if run.get("tokens_seen") is not None else "")]
    for ds in rec["datasets"]:
        lines.append(f"dataset     {ds['name']} ({ds['path']}): meta.json {ds['meta_sha256'][:16]}, "
                     f"{len(ds['shards'])} shards, tokenizer {ds['tokenizer_sha256'][:16]}")
    base = rec.get("base")
    lines.append(f"base        {base['path']}: {len(base['files'])} files" if base else "base        none (trained from "
                 "scratch)")
    return lines
