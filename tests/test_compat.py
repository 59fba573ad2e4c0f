"""The torch floor, and the GPU paths a CPU machine cannot run, made right by construction.

- one floor: pyproject, `validate stack` and `train` agree on it; an older torch is one line, not a traceback;
- compat.py picks the call this torch has (signature checks), on today's torch and under `make test-compat`;
- control collectives (CPU tensors) on a default group without a CPU backend, as `dist.backend: nccl` gives:
  emulated with the `cuda:fake` backend (its CPU tensors fail exactly as NCCL's do) in two real processes;
- torch.compile without a compiler (a `-runtime` container): eager, one warning. Triton cannot exist here: a
  stand-in module is put in `sys.modules` for the CUDA branch (said where it is done).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_one_line_error, cli_inprocess
from llmcluster.floor import TORCH_FLOOR, TORCH_FLOOR_TEXT, torch_too_old


def test_pyproject_states_the_same_floor():
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(r'"torch>=([\d.]+)"', text)
    assert m and tuple(int(x) for x in m.group(1).split(".")[:2]) == TORCH_FLOOR
    docker = (REPO / "Dockerfile").read_text()
    base = re.search(r"ARG BASE=pytorch/pytorch:([\d.]+)-", docker).group(1)
    assert torch_too_old(base) is None, base


def test_installed_torch_is_at_least_the_floor():
    assert torch_too_old(torch.__version__) is None


@pytest.mark.parametrize("version,ok", [("2.5.1+cu124", False), ("2.3.0", False), (TORCH_FLOOR_TEXT + ".0", True),
                                        ("2.11.0+cu130", True), ("2.13.0+cpu", True), ("3.0.0", True)])
def test_floor_comparison(version, ok):
    problem = torch_too_old(version)
    assert (problem is None) == ok
    if not ok:
        assert f"torch>={TORCH_FLOOR_TEXT}" in problem and version in problem


def test_stack_gate_fails_an_older_torch_naming_the_floor(monkeypatch, tmp_path, no_scheduler_probe):
    from llmcluster.validate import stack
    from llmcluster.validate.spec import ValidateSpec

    monkeypatch.setattr(stack, "torch_build", lambda: ("2.3.0", "12.1"))
    r = stack.check_stack(ValidateSpec(), tmp_path)
    item = next(i for i in r.items if i.name == "pytorch")
    assert item.status == "FAIL" and f"torch>={TORCH_FLOOR_TEXT}" in item.detail


def test_train_on_an_older_torch_is_one_line(capsys, monkeypatch):
    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "2.3.0" if name == "torch" else real(name))
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny")
    assert_one_line_error(proc, "torch 2.3.0", f"torch>={TORCH_FLOOR_TEXT}")


def test_compat_picks_the_calls_this_torch_has():
    import inspect

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from llmcluster.distributed import compat

    (name,) = compat.ddp_kwargs_without_buffer_sync()
    assert name in inspect.signature(DDP.__init__).parameters
    assert compat._accepts(distribute_tensor, "src_data_rank") == (
        "src_data_rank" in inspect.signature(distribute_tensor).parameters)
    assert compat._accepts(dcp.load, "no_dist") == ("no_dist" in inspect.signature(dcp.load).parameters)
    fully_shard, mp = compat.fsdp2()
    assert callable(fully_shard) and mp().param_dtype is None


_CONTROL_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # registers `fake` (the checkpointer no longer imports DCP)
    from llmcluster.distributed import process_groups as D
    from llmcluster.checkpoint.checkpointer import _any_rank
    rank, path = int(sys.argv[1]), sys.argv[2]
    # `cuda:fake`: the default group has a backend for CUDA tensors only, as `dist.backend: nccl` gives.
    store = dist.FileStore(path, 2)
    dist.init_process_group("cuda:fake", store=store, rank=rank, world_size=2)
    try:
        dist.all_reduce(torch.ones(1))
        print("default group took a CPU tensor")
    except RuntimeError as e:
        print("default group refuses CPU tensors:", str(e).splitlines()[0])
    D._make_control_group()
    env = D.DistEnv(rank, 2, rank, 2, torch.device("cpu"))
    print("max", D.all_reduce_max(float(rank + 3), env))
    print("gather", D.gather_floats(10.0 * rank + 1, env))
    print("any", _any_rank(rank == 1), flush=True)
    # Teardown is not under test here, and on torch 2.6 destroying a `cuda:fake` default group can hang one
    # rank (seen once in a loaded CI run): once both ranks are past every collective (the store says), exit.
    store.set(f"done{rank}", "1")
    store.wait([f"done{1 - rank}"])
    os._exit(0)
""")


def test_control_collectives_work_when_the_default_group_has_no_cpu_backend(tmp_path):
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", _CONTROL_WORKER, str(r), str(store)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "default group refuses CPU tensors: No backend type associated with device type cpu" in out, out
        assert "max 4.0" in out and "gather [1.0, 11.0]" in out and "any True" in out, out


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4), "1": torch.nn.Linear(4, 4)})


def _compile_warnings(device: torch.device) -> tuple[bool, list[str], _Blocks]:
    from llmcluster.train.parallelize import apply_compile

    m = _Blocks()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compiled = apply_compile(m, device)
    return compiled, [str(x.message) for x in w], m


def test_compile_without_a_cpp_compiler_runs_eager_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no g++/c++/clang++
    compiled, msgs, m = _compile_warnings(torch.device("cpu"))
    assert not compiled and len(msgs) == 1 and "no C++ compiler" in msgs[0] and "running eager" in msgs[0]
    assert all(type(b) is torch.nn.Linear for b in m.layers.values())


def test_compile_on_cuda_without_a_c_compiler_runs_eager_with_one_warning(monkeypatch, tmp_path):
    # Mocked: Triton cannot be installed on this CPU machine; a stand-in module makes `import triton` succeed
    # so that the compiler check (the part that fails in a `-runtime` container) is what decides.
    import types

    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    compiled, msgs, m = _compile_warnings(torch.device("cuda", 0))
    assert not compiled and len(msgs) == 1 and "no C compiler" in msgs[0] and "Triton" in msgs[0]
    # with a compiler named by $CC the check passes (no compile happens here: CUDA is absent)
    cc = Path(tmp_path / "mycc")
    cc.write_text("#!/bin/sh\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", "mycc")
    from llmcluster.train.parallelize import compile_available

    assert compile_available(torch.device("cuda", 0)) is None


@pytest.mark.parametrize("driver,torch_version", [("580.159.03", "2.11.0"), ("575.51.03", "2.10.0"),
                                                  ("570.26", "2.10.0"), ("560.35.03", "2.7.1"),
                                                  ("550.54.15", "2.6.0"), ("535.183.01", None)])
def test_gpu_check_pins_the_torch_whose_cuda_build_the_driver_runs(driver, torch_version):
    from llmcluster.floor import CUDA_MIN_DRIVER, PYPI_TORCH_CUDA, torch_for_driver, version_tuple

    assert torch_for_driver(driver) == torch_version
    assert all(torch_too_old(v) is None for v in PYPI_TORCH_CUDA)  # nothing below the floor is ever pinned
    if torch_version:
        assert version_tuple(driver) >= version_tuple(CUDA_MIN_DRIVER[PYPI_TORCH_CUDA[torch_version]])


@pytest.mark.parametrize("native", [True, False])
def test_the_demo_says_which_precision_it_computes_in_and_why(monkeypatch, native):
    from llmcluster.distributed import process_groups as D

    monkeypatch.setattr(D, "native_low_precision", lambda device, precision: native)
    note = D.precision_note(torch.device("cpu"), "bf16")
    assert note.startswith("bf16: this CPU has native bf16" if native else "fp32: this CPU has no avx512_bf16")
    assert D.precision_note(torch.device("cpu"), "fp32") == "fp32: as configured"


def test_a_capped_cpu_dispatch_computes_in_fp32_whatever_the_cpu_has(monkeypatch):
    """ATEN_CPU_CAPABILITY below AVX-512 (how `make test-avx2` stands an AVX-512 machine in for an AVX2 one) or a
    oneDNN ISA cap below its bf16 kernels emulates bf16: the run computes in fp32 and says why."""
    from llmcluster.distributed import process_groups as D

    code = ("import torch; from llmcluster.distributed import process_groups as D; "
            "print(D.native_low_precision(torch.device('cpu'), 'bf16')); print(D.precision_note(torch.device('cpu'), 'bf16'))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "False", out
    assert re.match(r"fp32: (torch's CPU kernels are capped at AVX2|this CPU has no avx512_bf16)", out[1]), out
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for isa, bf16, fp16 in (("ALL", True, True), ("AVX2", False, False), ("AVX512_CORE", False, False),
                            ("AVX512_CORE_BF16", True, False), ("AVX512_CORE_AMX", True, False),
                            ("AVX10_1_512", True, True)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert (D._dispatch_allows("BF16"), D._dispatch_allows("FP16")) == (bf16, fp16), isa
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert not D._dispatch_allows("BF16")


_TEARDOWN_WORKER = textwrap.dedent("""
    import sys, time, torch.distributed as dist
    from llmcluster.distributed import process_groups as D
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    if sys.argv[2] == "hang":  # stands in for torch 2.6's rare hang in a gloo destructor (not reproducible at will)
        dist.destroy_process_group = lambda: time.sleep(600)
    D.shutdown(teardown_timeout_s=2)
    print("returned", dist.is_initialized(), flush=True)
""")


@pytest.mark.parametrize("mode", ["clean", "hang"])
def test_a_teardown_that_hangs_exits_instead_of_holding_the_nodes(tmp_path, mode):
    import time

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _TEARDOWN_WORKER, str(tmp_path / "store"), mode], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if mode == "clean":
        assert (proc.returncode, proc.stdout) == (0, "returned False\n"), proc.stderr[-2000:]
    else:  # the watchdog: status 1, the stack that hung on stderr, long before the job's time limit
        assert proc.returncode == 1 and "returned" not in proc.stdout
        assert "Timeout" in proc.stderr and "shutdown" in proc.stderr, proc.stderr[-2000:]
        assert time.monotonic() - t0 < 60


def test_teardown_in_process_under_a_captured_stderr(tmp_path, capsys):
    """The watchdog needs a file descriptor; pytest's (or a notebook's) sys.stderr has none."""
    import torch.distributed as dist

    from llmcluster.distributed import process_groups as D

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    D.shutdown()
    assert not dist.is_initialized()


_LEAVE_WORKER = textwrap.dedent("""
    import atexit, sys, torch.distributed as dist
    from llmcluster.cli import leave_past_distributed_teardown
    from llmcluster.distributed import process_groups as D
    atexit.register(lambda: print("finalized"))
    if sys.argv[2] == "group":
        dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
        D.shutdown()
    print("work done")  # block-buffered (a pipe): it must still come out
    leave_past_distributed_teardown(3)
    sys.exit(4)
""")


@pytest.mark.parametrize("mode", ["group", "none"])
def test_a_process_that_ran_a_group_leaves_without_finalization(tmp_path, mode):
    """Finalization after gloo can abort the process (SIGABRT at exit): such a process leaves with os._exit,
    its output flushed and its exit code kept; a process without a group exits as usual."""
    proc = subprocess.run([sys.executable, "-c", _LEAVE_WORKER, str(tmp_path / "store"), mode], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if mode == "group":
        assert (proc.returncode, proc.stdout) == (3, "work done\n"), proc.stderr[-2000:]
    else:
        assert (proc.returncode, proc.stdout) == (4, "work done\nfinalized\n"), proc.stderr[-2000:]
