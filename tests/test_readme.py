"""The README runs: every fenced ```console block of README.md (and of the docs whose blocks run on a CPU) is
executed, in order, as a new user on a fresh clone would type it, on one temporary storage root. The README
opens with `make demo` and its examples continue from it (issue 34): its clone runs scripts/demo.sh first, with
DEMO_STEPS standing in for the demo's 320, so the walk meets a storage where the demo's run `llm-tiny` is
finished and exported.

A block is a list of `$ ` commands (a trailing backslash continues one), each followed by the output lines it
shows. A command passes when it exits as expected (0 unless annotated) and every output line it shows appears
in what it printed (stdout and stderr together), in order, with numbers and paths masked: the words and their
order are what is checked, not the figures of the machine the README was written on. `...` stands for anything,
a whole line or part of one. The clone's `.venv` is what `make demo` installs (torch and the package, no test
extras: demo_venv), on PATH as after `source .venv/bin/activate`; an example that needs an extra installs it
there with the command the document shows (`.venv/bin/pip install -e '.[k8s]'`).

Annotations, HTML comments on the lines right above a block (invisible on GitHub):
  <!-- readme: skip REASON -->                 the block is not run (placeholders, hardware, clusters)
  <!-- readme: skip "TEXT" REASON -->          ... only its commands that contain TEXT
  <!-- readme: dry-run ["TEXT"] REASON -->     parsed by llmcluster's own argument parser, not run
  <!-- readme: setup CMD -->                   a shell command run before the block (in the clone)
  <!-- readme: expect-exit N ["TEXT"] -->      the (TEXT) commands exit N
A block without commands must say why it is shown (skip). Each command's time is printed (`pytest -s`).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO, cli_env

# The documents whose examples run here, in the order a reader meets them. Each runs on a clone of its own.
DOCUMENTS = ["README.md", "docs/cluster.md", "docs/bring-up.md", "docs/monitoring.md"]
# `make demo` trains llm-tiny 320 steps (minutes): the README's walk needs the run finished and exported, not long
DEMO_STEPS = 10

ANNOTATION = re.compile(r"<!--\s*readme:\s*(skip|dry-run|setup|expect-exit)\b\s*(.*?)\s*-->")
SELECTOR = re.compile(r'"([^"]+)"\s*')


@dataclass
class Command:
    text: str                       # as typed (continuations joined)
    line: int                       # where it starts in the document
    shown: list[str] = field(default_factory=list)   # the output lines the document shows after it
    mode: str = "run"               # run | skip | dry-run
    reason: str = ""
    exit: int = 0


@dataclass
class Block:
    line: int
    commands: list[Command]
    setup: list[str]


def _annotate(block: Block, kind: str, rest: str, where: str) -> None:
    if kind == "setup":
        block.setup.append(rest)
        return
    code = None
    if kind == "expect-exit":
        m = re.match(r"(\d+)\s*", rest)
        assert m, f"{where}: expect-exit needs an exit code"
        code, rest = int(m.group(1)), rest[m.end():]
    m = SELECTOR.match(rest)
    text, reason = (m.group(1), rest[m.end():]) if m else (None, rest)
    targets = [c for c in block.commands if text is None or text in c.text]
    assert targets or text is None, f"{where}: {kind} {text!r} matches no command of the block"
    if kind != "expect-exit":
        assert reason, f"{where}: {kind} needs a reason"
    for c in targets:
        if code is not None:
            c.exit = code
        else:
            c.mode, c.reason = kind, reason


def parse(path: Path) -> list[Block]:
    """The ```console blocks of a Markdown file, with the annotations above each."""
    lines = path.read_text().splitlines()
    blocks, pending, i = [], [], 0
    while i < len(lines):
        s = lines[i].strip()
        if m := ANNOTATION.match(s):   # a line of its own, not one quoted in the text
            pending.append((m.group(1), m.group(2), i + 1))
        elif s == "```console":
            block, i = _read_block(lines, i)
            has_skip = False
            for kind, rest, at in pending:
                _annotate(block, kind, rest, f"{path.name}:{at}")
                has_skip |= kind == "skip" and not SELECTOR.match(rest)
            if not block.commands:
                assert has_skip, f"{path.name}:{block.line}: a console block without `$ ` commands: annotate skip REASON"
            blocks.append(block)
            pending = []
        elif s:
            pending = []        # annotations belong to the block right below them
        i += 1
    return blocks


def _read_block(lines: list[str], start: int) -> tuple[Block, int]:
    block = Block(line=start + 1, commands=[], setup=[])
    i = start + 1
    while lines[i].strip() != "```":
        s = lines[i].strip()
        if s.startswith("$ "):
            text, line = s[2:], i + 1
            while text.endswith("\\"):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            block.commands.append(Command(text, line))
        elif block.commands and s:
            block.commands[-1].shown.append(s)
        i += 1
    return block, i


# -- output comparison --------------------------------------------------------------------------------------------
def mask(line: str) -> str:
    """Numbers and paths (anything with a '/') masked, whitespace collapsed: the words and their order remain."""
    line = re.sub(r"\S*/\S*", "/", line)
    line = re.sub(r"\d+(?:[.,]\d+)*(?:e[+-]?\d+)?", "0", line)
    return " ".join(line.split())


def missing_lines(shown: list[str], printed: str) -> list[str]:
    """The shown lines that do not appear, in order, in what was printed (empty: the output matches)."""
    actual = [mask(a) for a in printed.splitlines()]
    j = 0
    for n, want in enumerate(s for s in shown if s != "..."):
        pattern = re.compile(".*".join(re.escape(p) for p in mask(want).split("...")))
        while j < len(actual) and not pattern.fullmatch(actual[j]):
            j += 1
        if j == len(actual):
            return [s for s in shown if s != "..."][n:]
        j += 1
    return []


# -- running ------------------------------------------------------------------------------------------------------
def fresh_clone(dest: Path) -> Path:
    """What a new user has: the checkout's files (links kept), no venv, no storage, no build output."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        local = {".git", "storage", ".pytest_cache", ".whl", "build", "dist", "gpu-check-out",
                 # what the README's steps leave in a clone (.gitignore)
                 "ansible", "cluster.yaml", "prometheus.yml", "report.json", "plots", "out", "job.yaml"}
        top = Path(folder) == REPO
        return {n for n in names if n == "__pycache__" or n.endswith(".egg-info")
                or (top and (n in local or n.startswith(".venv")))}

    shutil.copytree(REPO, dest, symlinks=True, ignore=ignore)
    return dest


def demo_venv() -> Path:
    """`make demo`'s venv, built by the Makefile's own `venv` recipe (torch's CPU wheel and the package with its
    own dependencies: no test extras) once per machine, ~2 min, under a key of what it installs (the recipe, the
    torch pin, pyproject.toml's [project] table, the python3 it runs): rebuilt when one changes. Its editable
    install points at this checkout; the walk's PYTHONPATH puts the clone's package first."""
    make, pyproject = (REPO / "Makefile").read_text(), (REPO / "pyproject.toml").read_text()
    recipe = make[make.index("$(VENV)/.installed:"):make.index("$(VENV)/.installed-test:")]
    torch_pin = re.search(r"^TORCH_VERSION \?= (\S+)", make, re.M).group(1)
    project = pyproject[pyproject.index("[project]"):pyproject.index("[project.optional-dependencies]")]
    python3 = subprocess.run(["python3", "-c", "import sys; print(sys.executable, sys.version)"],
                             capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join((recipe, torch_pin, project, python3)).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcluster" / f"readme-venv-{key}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:   # one build per machine, workers wait for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / ".installed").is_file():
            shutil.rmtree(cache, ignore_errors=True)
            t0 = time.monotonic()
            proc = subprocess.run(["make", "--no-print-directory", "venv", f"VENV={cache}"], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
            assert proc.returncode == 0, f"make venv: exit {proc.returncode}\n{proc.stdout[-3000:]}"
            print(f"{time.monotonic() - t0:7.1f} s  make venv VENV={cache} (once per machine)", flush=True)
    return cache


def with_demo_venv(clone: Path) -> Path:
    """The clone's `.venv`, as `make demo` leaves it: a copy of demo_venv() (hard links: seconds; a file pip
    replaces is a new file, so installing an extra here leaves the cache as it was), its scripts pointed here."""
    cache, venv = demo_venv(), clone / ".venv"
    t0 = time.monotonic()
    subprocess.run(["cp", "-al", str(cache), str(venv)], check=True)
    for f in (venv / "bin").iterdir():
        if f.is_file() and not f.is_symlink() and str(cache).encode() in (data := f.read_bytes()):
            f.unlink()   # a hard link to the cache's file: a new file, not a write through the link
            f.write_bytes(data.replace(str(cache).encode(), str(venv).encode()))
            f.chmod(0o755)
    print(f"{time.monotonic() - t0:7.1f} s  .venv: a copy of {cache}", flush=True)
    probe = "import importlib.util as u; print([m for m in ('pytest', 'kubernetes', 'transformers') if u.find_spec(m)])"
    found = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", probe], capture_output=True, text=True)
    assert found.stdout.strip() == "[]", f"make demo's .venv holds test extras: {found.stdout}{found.stderr}"
    return clone


def venv_bin(clone: Path) -> Path:
    """The clone's `.venv/bin` (with_demo_venv): python, llmcluster and torchrun as `make demo` installs them."""
    return clone / ".venv" / "bin"


def make_demo(clone: Path, env: dict[str, str]) -> float:
    """`make demo` (scripts/demo.sh, the venv already there), DEMO_STEPS steps; its seconds."""
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "scripts/demo.sh", "--set", f"train.steps={DEMO_STEPS}"], cwd=clone,
                          env={**env, "VENV": str(venv_bin(clone).parent)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert proc.returncode == 0, f"make demo: exit {proc.returncode}\n{proc.stdout[-4000:]}"
    assert f"finished step {DEMO_STEPS}" in proc.stdout and (clone / "storage" / "models" / "llm-tiny").is_dir()
    assert f"source {venv_bin(clone)}/activate" in proc.stdout, proc.stdout[-1000:]   # what comes next, said
    return time.monotonic() - t0


def llmcluster_argv(text: str) -> list[str]:
    argv = shlex.split(text, comments=True)
    argv = argv[:-1] if argv[-1:] == ["&"] else argv     # a server or a run put in the background
    if argv[:1] == ["llmcluster"]:
        return argv[1:]
    if argv[:1] == ["torchrun"] and argv.count("-m") and argv[argv.index("-m") + 1] == "llmcluster":
        return argv[argv.index("-m") + 2:]
    raise AssertionError(f"dry-run needs an llmcluster or torchrun command: {text}")


def dry_run(text: str) -> tuple[int, str]:
    """The command line checked by llmcluster's own parser (subcommand, flags, their types), not run."""
    import contextlib
    import io

    from llmcluster.cli import build_parser

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(llmcluster_argv(text))
        except SystemExit as e:
            return int(e.code or 0), err.getvalue()
    return 0, ""


def run_document(doc: str, clone: Path) -> list[tuple[str, str, float]]:
    # A newcomer's machine has no Slurm. The suite's own (tests/slurm_cluster.py) may be up beside this test on
    # another worker, and `cluster init` would then write its nodes and the shared root /storage into
    # ./cluster.yaml, where the README's later `monitor config` looks for the serving job the README started
    # under ./storage. SLURM_CONF=/dev/null: every Slurm command here fails at once (a missing file would make
    # them retry for 60 s), as on a machine without one.
    env = cli_env(PYTHONPATH=str(clone), PATH=f"{venv_bin(clone)}:{cli_env()['PATH']}", SLURM_CONF="/dev/null")
    timings, failures = [], []
    if doc == "README.md":
        timings.append(("make demo (scripts/demo.sh --set train.steps=%d)" % DEMO_STEPS, "run", make_demo(clone, env)))
    for block in parse(REPO / doc):
        for cmd in block.setup:
            proc = subprocess.run(["bash", "-c", cmd], cwd=clone, env=env, capture_output=True, text=True,
                                  timeout=60)
            if proc.returncode:
                failures.append(f"{doc}:{block.line}: setup {cmd}: exit {proc.returncode}: {proc.stderr[-500:]}")
        for c in block.commands:
            where = f"{doc}:{c.line}: $ {c.text}"
            if c.mode == "skip":
                timings.append((f"{where}  ({c.reason})", "skip", 0.0))
                continue
            t0 = time.monotonic()
            if c.mode == "dry-run":
                code, out = dry_run(c.text)
            else:
                assert not c.text.rstrip().endswith("&"), f"{where}: a background command: annotate skip"
                proc = subprocess.run(["bash", "-c", c.text], cwd=clone, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, timeout=600)
                code, out = proc.returncode, proc.stdout
            took = time.monotonic() - t0
            timings.append((where, c.mode, took))
            print(f"{took:7.1f} s  exit {code}  {where[:150]}", flush=True)   # progress, under -s
            if code != c.exit:
                failures.append(f"{where}\n  exit {code}, expected {c.exit}; output:\n{out[-3000:]}")
            elif c.mode == "run" and (missing := missing_lines(c.shown, out)):
                failures.append(f"{where}\n  shown but not printed: {missing[0]!r}; output:\n{out[-3000:]}")
    for where, mode, took in timings:
        print(f"{took:7.1f} s  {mode:8.8s}  {where[:150]}")
    print(f"{sum(t for _, _, t in timings):7.1f} s  in all ({doc})")
    assert not failures, "\n\n".join(failures)
    return timings


@pytest.mark.slow
@pytest.mark.timeout(2400)   # <= 5 min on an idle 2-core machine; a loaded CI runner takes several times that
@pytest.mark.parametrize("doc", DOCUMENTS)
def test_document_examples_run_as_written(doc, tmp_path):
    run_document(doc, with_demo_venv(fresh_clone(tmp_path / "clone")))


# -- the checker itself -------------------------------------------------------------------------------------------
def test_masking_keeps_words_and_order():
    shown = ["step 0 val 8.3528 (untrained)", "...", "checkpoint ./storage/x/step_10 (0.48 s)"]
    printed = "run x\nstep 0 val 7.1 (untrained)\nstep 10 loss 3\ncheckpoint /tmp/a/b/step_20 (1.2 s)\n"
    assert missing_lines(shown, printed) == []
    assert missing_lines(["step 0 lr 1"], printed) == ["step 0 lr 1"]                     # a word changed
    assert missing_lines(["checkpoint / (0 s)", "step 0 val 0 (untrained)"], printed)    # order changed
    assert missing_lines(["run x: ... done"], "run x: DDP (world 2) done\n") == []


def test_annotations_select_commands(tmp_path):
    md = tmp_path / "x.md"
    md.write_text('<!-- readme: skip "kill" placeholder pids -->\n<!-- readme: expect-exit 2 "never" -->\n'
                  "```console\n$ kill -USR2 <pids>\n$ llmcluster train -c a \\\n    --resume never\nerror\n```\n"
                  "\ntext\n<!-- readme: skip shown only -->\n```console\noutput\n```\n")
    a, b = parse(md)
    assert [(c.mode, c.exit) for c in a.commands] == [("skip", 0), ("run", 2)]
    assert a.commands[1].text == "llmcluster train -c a  --resume never" and a.commands[1].shown == ["error"]
    assert b.commands == []
    md.write_text("```console\noutput\n```\n")
    with pytest.raises(AssertionError, match="without `\\$ ` commands"):
        parse(md)


def test_every_document_parses_and_every_dry_run_parses():
    for doc in DOCUMENTS:
        for block in parse(REPO / doc):
            for c in block.commands:
                if c.mode == "dry-run":
                    assert dry_run(c.text)[0] == 0, (doc, c.line, c.text)
