"""Shared test helpers: run the real CLI in a subprocess, and free TCP ports for torchrun.

Every test states its own world (issue 33): it runs in a working directory of its own (the checkout's tracked
entries linked in, SHIPPED, so the README's relative paths resolve, but never a `./cluster.yaml` or `./storage`
a user left in the clone), with no `LLMCLUSTER_*` variable of the caller's
environment but the engine locations (MACHINE_ENV). A test that wants a variable sets it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The checkout's own top-level entries (what git tracks), which the README and the tests name relative to it
# (configs/llm_tiny.yaml, plans/..., scripts/...); never what a user's steps leave beside them (cluster.yaml, storage/).
SHIPPED = ("configs", "plans", "clusters", "monitoring", "llmcluster", "scripts", "benchmarks", "docs", "tests",
           "pyproject.toml", "README.md", "Makefile", "Dockerfile")
# Where this machine keeps the engines and caches, not a test's state: kept from the caller's environment.
MACHINE_ENV = ("LLMCLUSTER_VLLM_PYTHON", "LLMCLUSTER_LMEVAL_PYTHON", "LLMCLUSTER_CACHE", "LLMCLUSTER_CPU_THREADS")
# One thread per process, in the pytest workers and every run they start (a test that is about threads sets its
# own): the suite runs more processes than the machine has cores, and a process with 2 threads there waits for
# its other thread's turn on a core at every small op. Measured 2026-12-08, 2 cores under the suite's load: 64k
# float64 sqrt 0.35 ms on 1 thread, 32 ms on 2; a 5-step llm_tiny run 15 CPU-s / 32 s wall on 1, 32 / 67 on 2.
# Set before torch is imported (OpenMP reads it when it loads); the trainer reads LLMCLUSTER_CPU_THREADS
# (distributed/process_groups.py: torchrun sets OMP_NUM_THREADS itself).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("LLMCLUSTER_CPU_THREADS", "1")
# inductor compiles in the process that asks, not in a pool of 2 workers that each import torch first (a compiled
# parity case: 43 -> 39 CPU-s, 58 -> 50 s, measured 2026-12-08 on 2 loaded cores, cold caches both)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "torch" in sys.modules:   # imported before this file (a plugin): its pool already sized
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def clean_dir(path: Path) -> Path:
    """`path` as a working directory: the shipped files linked in, nothing else (no cluster.yaml, no storage)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED:
        if (REPO / name).exists():
            (path / name).symlink_to(REPO / name)
    return path


def _scrub_env(mp: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("LLMCLUSTER_") and k not in MACHINE_ENV:
            mp.delenv(k)
    # `python -m llmcluster` from any working directory imports this checkout, installed or not
    mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))


@pytest.fixture(scope="session", autouse=True)
def _session_world(tmp_path_factory):
    """Session fixtures (trained runs, datasets, servers) start in a clean directory and environment too."""
    with pytest.MonkeyPatch.context() as mp:
        _scrub_env(mp)
        mp.chdir(clean_dir(tmp_path_factory.mktemp("session-cwd")))
        yield


@pytest.fixture(autouse=True)
def _own_world(tmp_path_factory, monkeypatch):
    """Each test in a working directory of its own: what one writes to ./ (cluster init, monitor config -o) no
    other reads, and the clone's ./cluster.yaml or ./storage reach none."""
    _scrub_env(monkeypatch)
    monkeypatch.chdir(clean_dir(tmp_path_factory.mktemp("cwd")))


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)      # already scrubbed of the caller's LLMCLUSTER_* (_own_world)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600,
            check: bool = False) -> subprocess.CompletedProcess:
    """`python -m llmcluster ARGS` as a user would run it, in the test's own working directory unless `cwd`;
    returns the CompletedProcess (text)."""
    proc = subprocess.run([sys.executable, "-m", "llmcluster", *map(str, args)], cwd=cwd or Path.cwd(),
                          env=env or cli_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmcluster {' '.join(map(str, args))} -> {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Bad input: exit 2, exactly one line on stderr, no traceback, and the line names what is wrong."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def cli_inprocess(capsys, *args) -> subprocess.CompletedProcess:
    """`llmcluster ARGS` in this process (no interpreter start-up): same parser, same error handling."""
    from llmcluster.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` mounted on `path` (a full disk for real: issue 64), unmounted at the end; the test is
    skipped where mounting needs a root this user is not."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def resize_disk(path: Path, size: str) -> None:
    """small_disk's tmpfs at `path` made `size` (space freed, as a user would)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    run_cli("storage", "init", "--root", root, check=True)
    return root


# -- a tiny model and dataset shared by the training tests --------------------------------------
TINY = [
    "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
    "model.vocab_size=257", "model.max_seq_len=64", "data.dataset=tiny", "data.seq_len=32",
    "train.micro_batch=4", "train.precision=fp32", "train.lr=3e-3", "train.warmup_steps=2",
    "log.interval=1", "log.eval_interval=5", "log.eval_batches=2", "log.progress=false",
]


def overrides(*items: str) -> list[str]:
    """['--set', k=v, ...] for the tiny shape plus `items` (later ones win)."""
    out: list[str] = []
    for kv in (*TINY, *items):
        out += ["--set", kv]
    return out


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """A storage root with a byte-tokenized dataset 'tiny' made from the stdlib's json and email packages."""
    import sysconfig

    root = tmp_path_factory.mktemp("tiny") / "storage"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    run_cli("storage", "init", "--root", root, check=True)
    run_cli("data", "prepare", "--root", root, "--name", "tiny", "--source", stdlib / "json", stdlib / "email",
            "--tokenizer", "byte", "--val-fraction", "0.2", check=True)
    return root


@pytest.fixture(scope="session")
def fault_data(tmp_path_factory) -> Path:
    """faultkit's byte-level dataset `t`, made once for the fault-tolerance tests (read only: each test's storage
    links it in, faultkit.fresh_root)."""
    from faultkit import make_dataset

    return make_dataset(tmp_path_factory.mktemp("fault-data") / "storage")


@pytest.fixture
def fault_root(fault_data, tmp_path) -> Path:
    """A fresh storage root of this test's own with fault_data's dataset linked in (the fault-tolerance modules)."""
    from faultkit import fresh_root

    return fresh_root(fault_data, tmp_path)


@pytest.fixture(scope="session")
def fault_run8(fault_data, tmp_path_factory) -> Path:
    """A storage root where faultkit's llm-tiny ran 8 steps with checkpoints at 4 and 8: the start of many fault
    tests, trained once per session; a test copies it (faultkit.copy_run) before it corrupts or resumes it."""
    from faultkit import fresh_root, sets

    root = fresh_root(fault_data, tmp_path_factory.mktemp("fault-run8"))
    run_cli("train", "-c", "llm_tiny", "--root", root, *sets(train__steps=8, checkpoint__interval_steps=4),
            check=True)
    return root


def repo_source_dataset(root: Path, n_files: int) -> Path:
    """Storage at `root` with a byte-level dataset 'src' made from the first `n_files` of this repo's own
    Python files (real code, no vocabulary to train)."""
    src = root.parent / "src"
    src.mkdir(parents=True)
    for i, f in enumerate(sorted((REPO / "llmcluster").rglob("*.py"))[:n_files]):
        (src / f"{i}_{f.name}").write_text(f.read_text())
    run_cli("storage", "init", "--root", root, check=True)
    run_cli("data", "prepare", "--root", root, "--name", "src", "--source", src, "--tokenizer", "byte",
            check=True)
    return root


def read_metrics(root: Path, run: str) -> list[dict]:
    import json

    path = root / "logs" / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def torchrun(nproc: int, *args: str, env: dict | None = None, timeout: float = 600,
             extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m llmcluster ARGS` (real processes, gloo on CPU)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *extra, "-m", "llmcluster", *map(str, args)]
    return subprocess.run(cmd, cwd=Path.cwd(), env=env or cli_env(), capture_output=True, text=True, timeout=timeout)


def train_runs(nproc: int, runs: list[list[str]]) -> list[str]:
    """`torchrun --nproc-per-node NPROC tests/train_runs_worker.py`: each of `runs` (`train ...` arguments) in
    turn through the CLI's entry, asserted to exit 0; rank 0's output of each run. torch 2.6's rare gloo hang
    in destroy_process_group after the last run finished ends in the trainer's teardown watchdog (exit 1 with
    the stack, docs/fault-tolerance.md), not in training: tolerated here, and only that."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / "train_runs_worker.py"), *[a for i, r in enumerate(runs) for a in ["--next"][:i] + r]]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300 * len(runs))
    outputs = re.split(r"^=== run \d+\n", proc.stdout, flags=re.M)[1:]
    teardown_hang = len(outputs) == len(runs) and re.search(r"finished step \d+", outputs[-1]) \
        and "Timeout (0:02:00)!" in proc.stderr and "in shutdown" in proc.stderr
    names = [a for r in runs for a in r if a.startswith("run.name=")]
    assert proc.returncode == 0 or teardown_hang, \
        f"exit {proc.returncode}: {names}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert len(outputs) == len(runs), proc.stdout[-3000:]
    return outputs


@pytest.fixture
def no_scheduler_probe(monkeypatch):
    """`validate stack` without its scheduler item, for tests of the other items: sinfo's answer is the machine's
    (the test cluster's controller up, or down, and then sinfo waits out its 5 s for nothing). The item is checked
    for real by test_validate.py's end-to-end runs."""
    from llmcluster.validate import stack

    def skipped(env: dict):
        r = stack.CheckResult("schedulers")
        r.add("scheduler", "SKIP", detail="not probed in this test")
        return r

    monkeypatch.setattr(stack, "_schedulers", skipped)


def assert_nowhere_under(root: Path, secret: str) -> None:
    """No file under `root` (contents or name) contains `secret`: grep -r, as an auditor would."""
    p = subprocess.run(["grep", "-rlF", "--", secret, str(root)], capture_output=True, text=True)
    assert p.returncode == 1, f"{secret!r} found in: {p.stdout or p.stderr}"
    named = [f for f in root.rglob("*") if secret in f.name]
    assert not named, named


# -- one vLLM server for the serving tests (issue 27) -------------------------------------------------------------
VLLM_BASE, VLLM_LORA, VLLM_JOB = "vllm-demo", "vllm-lora", "vllm-test"


def vllm_python() -> str:
    """The CPU engine's python (scripts/vllm_venv.sh builds its venv once per machine, ~3 min, and prints it)."""
    p = subprocess.run(["bash", str(REPO / "scripts" / "vllm_venv.sh")], capture_output=True, text=True,
                       timeout=1800)
    assert p.returncode == 0, f"scripts/vllm_venv.sh failed (`make vllm`):\n{p.stderr[-3000:]}"
    return p.stdout.split()[-1]


@pytest.fixture(scope="session")
def vllm_exports(tmp_path_factory):
    """The serving tests' models, trained and exported once per session: a demo-sized model (llm_tiny's shape)
    trained briefly on byte-tokenized chats and exported (its chat template and end-of-turn token with it); a LoRA
    run that imports that export as its Hugging Face base (train.init_from), exported. Returns the storage root."""
    from chat_helpers import chat_records

    base = tmp_path_factory.mktemp("vllm")
    root = base / "storage"
    (base / "chat.jsonl").write_text(chat_records(60))
    run_cli("storage", "init", "--root", root, check=True)
    run_cli("data", "prepare", "--root", root, "--name", "chat", "--format", "chat", "--source",
            base / "chat.jsonl", "--tokenizer", "byte", "--val-fraction", "0", check=True)
    common = ["--root", root, "--set", "data.dataset=chat", "--set", "data.seq_len=64", "--set",
              "train.micro_batch=4", "--set", "train.precision=fp32", "--set", "train.warmup_steps=2",
              "--set", "log.progress=false", "--set", "log.eval_interval=1000"]
    run_cli("train", "--config", "llm_tiny", *common, "--set", "model.vocab_size=259", "--set", "train.steps=20",
            "--set", f"run.name={VLLM_BASE}", check=True)
    run_cli("export", "--run", VLLM_BASE, "--root", root, check=True)
    export = root / "models" / VLLM_BASE
    (base / "lora.yaml").write_text("checkpoint: {interval_steps: 1000}\n")  # no model section: init_from's
    run_cli("train", "--config", base / "lora.yaml", *common, "--set", f"train.init_from={export}",
            "--set", "train.lora={rank: 4, alpha: 8, targets: [q_proj, v_proj, down_proj]}", "--set", "train.lr=1e-2",
            "--set", "train.steps=10", "--set", f"run.name={VLLM_LORA}", check=True)
    run_cli("export", "--run", VLLM_LORA, "--root", root, check=True)
    return root


@pytest.fixture(scope="session")
def vllm_server(vllm_exports):
    """One real vLLM server (the CPU engine) shared by the session's serving tests, LoRA enabled:
    `serve start --scheduler local` of vllm_exports' LoRA export serves the base under its name and the adapter
    under the run's."""
    from types import SimpleNamespace

    python = vllm_python()
    root = vllm_exports
    url, key, p, took = serve_locally(VLLM_LORA, VLLM_JOB, root, python)
    yield SimpleNamespace(base_url=url, model=VLLM_BASE, lora=VLLM_LORA, export_dir=root / "models" / VLLM_BASE,
                          lora_dir=root / "models" / VLLM_LORA, root=root, name=VLLM_JOB, python=python,
                          start=p, startup_s=took, key=key, headers={"Authorization": f"Bearer {key}"})
    run_cli("jobs", "cancel", VLLM_JOB, "--root", root)


def serve_locally(model, name: str, root: Path, python: str):
    """`serve start --scheduler local` of `model` (an export or a run) as job `name`: (its /v1 URL, its API key,
    serve start's process, seconds to healthy). Stop it with `jobs cancel NAME`."""
    import time

    t0 = time.monotonic()
    p = run_cli("serve", "start", "--model", model, "--name", name, "--root", root, "--scheduler", "local",
                "--engine-python", python, timeout=900)
    took = time.monotonic() - t0
    if p.returncode != 0:
        run_cli("jobs", "cancel", name, "--root", root)
        raise AssertionError(f"serve start -> {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}\n"
                             f"{(root / 'logs' / name / 'server.log').read_text()[-4000:]}")
    url = next(ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("endpoint "))
    print(f"vLLM started and answered in {took:.0f} s", file=sys.stderr)
    key = (root / "logs" / name / "api_key").read_text().strip()    # serve start's key (issue 32)
    return url, key, p, took


# -- a cluster of network namespaces (issue 51: tests/netcluster.py) ------------------------------------------------
@pytest.fixture(scope="module")
def netcluster_module():
    """Three nodes (n0 the head, n1, n2) and an outsider, made once per test module (~1 s)."""
    from netcluster import make_cluster

    cluster = make_cluster(3)
    yield cluster
    cluster.down()


@pytest.fixture
def netcluster(netcluster_module):
    """The module's namespace cluster, every fault undone and every process it started stopped after the test."""
    yield netcluster_module
    netcluster_module.heal()
    netcluster_module.stop_all()


SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def xdist_group(item) -> str | None:
    """`make test` runs the suite on pytest-xdist workers (`--dist loadgroup`): the tests that share one thing
    the machine has once run on one worker, one after the other. The real Slurm cluster (its nodes and its
    controller, which provision's apply restarts) and the session's vLLM server (a session fixture is made once
    per worker: grouped, one server starts, not one per worker)."""
    if item.get_closest_marker("slurm"):
        return "slurm"
    if {"vllm_server", "vllm_exports"} & set(getattr(item, "fixturenames", ())):
        return "vllm"
    return None


def module_fixture_group(item) -> str | None:
    """The tests of a module that share a module-scoped fixture of their own (most often runs trained once for
    the module: test_train's three runs, test_parallel's reference and merged launches, test_eval's 200 steps)
    go to one worker. Spread over two, each worker made the fixture again: a 2-worker `make test` trained ~15
    of them twice (measured 2026-12-06, a CPU map of every test)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in getattr(item, "fixturenames", ()):
        if defs.get(name) and defs[name][-1].scope == "module":   # [-1]: the definition this test gets
            return f"module:{item.module.__name__}"
    return None


def slow_first(items) -> None:
    """The slow tests start first, each xdist group whole and in its own order (a group holding one slow test
    moves with it): the workers take tests in collection order, and a 3-5 minute test taken last (the README
    walk sits late in the alphabet) ran alone on one worker while the others had finished. Longest first is the
    classic bound on such a tail (LPT scheduling)."""
    def scope(item) -> str:
        mark = item.get_closest_marker("xdist_group")
        return (mark.args[0] if mark.args else mark.kwargs.get("name", "")) if mark else item.nodeid

    slow = {scope(i) for i in items if i.get_closest_marker("slow")}
    items.sort(key=lambda i: scope(i) not in slow)   # stable: the collection's order within each part


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: shares the one real Slurm or the session's vLLM server (set here, "
                            "from xdist_group): make test runs these one after the other beside the workers")


@pytest.hookimpl(tryfirst=True)   # before -k/-m deselect, so the list is checked against everything collected
def pytest_collection_modifyitems(config, items):
    """tests/slow_tests.txt: the measured-slow tests `make test-fast` leaves out, marked `slow` here."""
    listed = {ln.strip() for ln in SLOW_LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    ids = {item.nodeid for item in items}
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
        group = xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            item.add_marker(pytest.mark.serial)   # make test's stream beside the workers (scripts/test_suite.sh)
        elif not item.get_closest_marker("xdist_group") and (group := module_fixture_group(item)):
            item.add_marker(pytest.mark.xdist_group(group))
    slow_first(items)
    if not any("::" in a for a in config.args):   # whole files collected: a listed id they lack is stale
        files = {i.split("::")[0] for i in ids}
        stale = sorted(i for i in listed - ids if i.split("::")[0] in files)
        if stale:
            raise pytest.UsageError(f"tests/slow_tests.txt names tests that do not exist: {stale[:3]}")


# -- each test's CPU seconds, beside its wall time (issue 74) -------------------------------------------------------
# On 2 shared cores a test's wall time is mostly its neighbours'; the CPU it and the processes it waited for used
# is its own cost. Written into the JUnit XML (property cpu_s) that scripts/suite_summary.py tabulates. Not counted:
# a process the test started and never waited for (a server killed at teardown), and module/session fixtures are
# charged to the first test that uses them, as their wall time is.
def _cpu_seconds() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


_CPU_AT_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_AT_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and _CPU_AT_START in item.stash:   # before the report that carries the properties
        item.user_properties.append(("cpu_s", f"{_cpu_seconds() - item.stash[_CPU_AT_START]:.2f}"))
    yield
