"""storage: sequential write (fsync included) and read GB/s, small-file create/stat rate, per /storage area.

The read must come from the storage, not from the page cache the write just filled: reads use O_DIRECT
where the filesystem allows it, else the cached pages are dropped first with posix_fadvise(DONTNEED)
(honoured by local filesystems, NFS and Lustre clients; on tmpfs the "storage" is memory, and the report
says so). fio is used when it is on PATH (direct I/O, fsync at the end), the built-in writer otherwise.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from llmcluster.storage.layout import AREAS
from llmcluster.validate.result import FAIL, PASS, SKIP, CheckResult, fmt_bytes, fmt_rate, grade
from llmcluster.validate.spec import ValidateSpec

BLOCK = 4 << 20     # 4 MiB writes/reads: large sequential I/O, a multiple of every O_DIRECT alignment
STORAGE_PASS_AT, STORAGE_WARN_AT = 0.8, 0.5


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (longest mount-point prefix in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    p = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3:
            mnt = parts[1].replace("\\040", " ")
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


def write_file(path: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` sequentially and fsync them."""
    block = os.urandom(BLOCK)    # incompressible, so a compressing filesystem cannot flatter the number
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(BLOCK, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_file(path: Path) -> tuple[float, str]:
    """(seconds to read the whole file, how the page cache was avoided)."""
    buf = mmap.mmap(-1, BLOCK)   # page-aligned, as O_DIRECT requires
    methods = (("O_DIRECT", os.O_DIRECT),) if hasattr(os, "O_DIRECT") else ()
    for method, flag in methods + (("fadvise DONTNEED", 0),):
        try:
            fd = os.open(path, os.O_RDONLY | flag)
        except OSError:      # tmpfs and some FUSE filesystems refuse O_DIRECT
            continue
        try:
            if not flag:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.readv(fd, [buf]) > 0:
                pass
            return time.perf_counter() - t0, method
        except OSError:
            if not flag:     # a plain read failed: that is the storage's problem, not the method's
                raise
        finally:
            os.close(fd)
    raise AssertionError("unreachable")


def small_files(directory: Path, count: int) -> tuple[float, float]:
    """(files created per second, files stat'ed per second) for `count` 4 KiB files."""
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(4096)
    t0 = time.perf_counter()
    for i in range(count):
        (directory / f"f{i:06d}").write_bytes(data)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)            # the directory entries too, or "created" means "in the dentry cache"
    os.close(dfd)
    created = count / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(count):
        os.stat(directory / f"f{i:06d}")
    return created, count / (time.perf_counter() - t0)


def fio_seq(path: Path, nbytes: int, rw: str) -> float:
    """GB/s of fio sequential `rw` ('write' or 'read') with direct I/O and a final fsync."""
    cmd = ["fio", "--name=llmcluster", f"--filename={path}", f"--rw={rw}", "--bs=4M", f"--size={nbytes}",
           "--direct=1", "--end_fsync=1", "--ioengine=psync", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    return parse_fio(out, rw)


def parse_fio(output: str, rw: str) -> float:
    """fio's JSON -> GB/s (bw_bytes is bytes per second)."""
    job = json.loads(output[output.index("{"):])["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


MIB = 1 << 20
FREE_SHARE = 0.05        # all nodes together write at most this share of an area's free space
MIN_BYTES = 16 * MIB     # below this a sequential figure means little: skipped instead


def file_size(free: int, nodes: int, quick: bool, size: int | None = None) -> int:
    """Bytes each node writes per area: --storage-size or the default (2 GiB, quick 64 MiB), capped so
    that `nodes` nodes writing at once into one shared filesystem (its free space is all of theirs) use
    at most FREE_SHARE of it. A nearly full filesystem gets small files, or none (0: below MIN_BYTES)."""
    want = size or ((64 * MIB) if quick else (2 << 30))
    got = min(want, int(free * FREE_SHARE / max(nodes, 1))) // MIB * MIB
    return got if got >= min(MIN_BYTES, want) else 0


def areas(root: Path) -> list[tuple[str, Path]]:
    """The /storage areas that exist under root, or the root itself when it has none."""
    found = [(a, root / a) for a in AREAS if (root / a).is_dir()]
    return found or [("root", root)]


def write_plan(root: Path, quick: bool, size: int | None = None, nodes: int = 1) -> str:
    """What the storage check will write, said before any check runs: a full `validate` writes 2 GiB into
    every area (10 GiB on a fresh storage root), which nobody should learn from a full disk."""
    if not root.is_dir():
        return f"storage: {root} does not exist: nothing will be written"
    sizes = [file_size(shutil.disk_usage(p).free, nodes, quick, size) for _, p in areas(root)]
    return (f"storage: will write up to {fmt_bytes(max(sizes))} into each of {len(sizes)} area(s) under {root} "
            f"({fmt_bytes(sum(sizes))} in all, one area at a time, removed afterwards; --quick or "
            "--storage-size SIZE writes less)")


def check_storage(root: Path, spec: ValidateSpec, quick: bool, size: int | None = None,
                  nodes: int = 1) -> CheckResult:
    r = CheckResult("storage")
    if not root.is_dir():
        r.add(str(root), SKIP, detail="storage root does not exist (llmcluster storage init --root ...)")
        return r
    nfiles = 200 if quick else 2000
    use_fio = shutil.which("fio") is not None
    for area, path in areas(root):
        kind = fs_type(path)
        free = shutil.disk_usage(path).free
        nbytes = file_size(free, nodes, quick, size)
        row = {"area": area, "path": str(path), "fs": kind, "bytes": nbytes, "tool": "fio" if use_fio else "builtin"}
        r.data.setdefault("areas", []).append(row)
        if not os.access(path, os.W_OK):
            note = "read-only (as workers should mount datasets)" if area == "datasets" else "not writable"
            r.add(f"{area} ({kind})", SKIP if area == "datasets" else FAIL, detail=note)
            continue
        if nbytes == 0:
            r.add(f"{area} ({kind})", SKIP, detail=f"{fmt_bytes(free)} free: too little for {nodes} node(s) "
                  f"to write {fmt_bytes(MIN_BYTES)} each within {FREE_SHARE:.0%} of it")
            continue
        work = path / f".llmcluster-validate-{socket.gethostname()}-{os.getpid()}"
        work.mkdir(exist_ok=True)
        try:
            target = work / "seq.bin"
            if use_fio:
                row["write_GBps"] = fio_seq(target, nbytes, "write")
                row["read_GBps"], row["read_method"] = fio_seq(target, nbytes, "read"), "fio --direct=1"
            else:
                row["write_GBps"] = nbytes / write_file(target, nbytes) / 1e9
                seconds, row["read_method"] = read_file(target)
                row["read_GBps"] = nbytes / seconds / 1e9
            target.unlink()
            row["create_per_s"], row["stat_per_s"] = small_files(work / "small", nfiles)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        expect = spec.storage.get(area)
        cache_note = " (tmpfs: memory-backed)" if kind == "tmpfs" else ""
        for what, unit, key, want in (
                ("write", "GB/s", "write_GBps", expect and expect.write_GBps),
                ("read", "GB/s", "read_GBps", expect and expect.read_GBps),
                ("small-file create", "files/s", "create_per_s", expect and expect.files_per_s)):
            got = row[key]
            detail = f"{fmt_bytes(nbytes)}, fsync" if what == "write" else \
                f"{fmt_bytes(nbytes)}, {row['read_method']}" if what == "read" else \
                f"{nfiles} x 4 KiB; stat {row['stat_per_s']:,.0f}/s"
            if want:
                ratio = got / want
                r.add(f"{area} {what}", grade(ratio, STORAGE_PASS_AT, STORAGE_WARN_AT), fmt_rate(got, unit),
                      f"{ratio:.0%} of expected {want:g} {unit}; {detail}{cache_note}")
            else:
                r.add(f"{area} {what}", PASS, fmt_rate(got, unit), f"{detail}{cache_note} ({kind})")
    return r
