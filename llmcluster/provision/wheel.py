"""The llmcluster wheel the ML level installs: nodes need no package index for llmcluster itself.

Where it comes from, first that applies: `provision --wheel PATH`, the spec's `provision.wheel`, or a wheel
built here with `pip wheel --no-deps` from the checkout this llmcluster runs from (copied to a temporary
directory first: the build leaves nothing in the checkout). Installed from a wheel, llmcluster has no
checkout to build from: provision then refuses in one line. The wheel's own Requires-Dist (minus torch,
which the level installs first at the pinned version, and the extras) is what the level installs beside it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

import llmcluster
from llmcluster.errors import UserError

_BUILT: dict[str, Path] = {}          # source fingerprint -> wheel built in this process
_TMP: list[tempfile.TemporaryDirectory] = []


def checkout() -> Path | None:
    """The source checkout this llmcluster runs from, or None when it was installed from a wheel."""
    root = Path(llmcluster.__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and 'name = "llmcluster"' in pyproject.read_text():
        return root
    return None


def _fingerprint(src: Path) -> str:
    h = hashlib.sha256()
    for f in sorted((src / "llmcluster").rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts:
            st = f.stat()
            h.update(f"{f.relative_to(src)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for name in ("pyproject.toml", "README.md"):
        h.update((src / name).read_bytes())
    return h.hexdigest()


def build(src: Path) -> Path:
    """`pip wheel --no-deps` of the checkout, from a copy of what the wheel holds; once per process and source."""
    key = _fingerprint(src)
    if key in _BUILT and _BUILT[key].is_file():
        return _BUILT[key]
    tmp = tempfile.TemporaryDirectory(prefix="llmcluster-wheel-")
    _TMP.append(tmp)
    copy = Path(tmp.name) / "llmcluster-src"   # not `src`: setuptools takes a directory of that name for a layout
    shutil.copytree(src / "llmcluster", copy / "llmcluster", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(src / name, copy / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(Path(tmp.name) / "dist"), str(copy)]
    if importlib.util.find_spec("setuptools"):
        cmd.insert(5, "--no-build-isolation")   # this Python's setuptools: no index needed to build
    p = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted((Path(tmp.name) / "dist").glob("llmcluster-*.whl"))
    if p.returncode != 0 or not wheels:
        last = (p.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise UserError(f"pip wheel --no-deps {src} failed ({last}): build one yourself and give --wheel PATH")
    _BUILT[key] = wheels[0]
    return wheels[0]


def read_wheel(wheel: Path) -> tuple[str, list[str]]:
    """(version, Requires-Dist without torch and the extras) of an llmcluster wheel; anything else is refused."""
    try:
        with zipfile.ZipFile(wheel) as z:
            meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
            text = z.read(meta).decode() if meta else ""
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"--wheel {wheel}: not a wheel ({e})") from None
    msg = Parser().parsestr(text)
    if (msg.get("Name") or "").lower() != "llmcluster":
        raise UserError(f"--wheel {wheel}: not an llmcluster wheel (its METADATA names {msg.get('Name')!r})")
    reqs = [r.strip() for r in msg.get_all("Requires-Dist") or []]
    return msg.get("Version") or "", [r for r in reqs if "extra ==" not in r and not r.lower().startswith("torch")]


def resolve(given: str | None) -> Path:
    """The wheel to ship: `given` (the flag or the spec), else one built from the checkout, else a refusal."""
    if given:
        path = Path(given).expanduser()
        if not path.is_file() or path.suffix != ".whl":
            raise UserError(f"--wheel {given}: no such .whl file")
        return path
    src = checkout()
    if src is None:
        raise UserError(f"llmcluster runs from an installed package ({Path(llmcluster.__file__).parent}), not a "
                        "checkout: give --wheel PATH (or provision.wheel) for the nodes' ml level")
    return build(src)
