"""Process-group setup from the torchrun (or Slurm) environment, and the one mesh of the run.

`ParallelDims` holds the degrees (pp × dp_replicate × dp_shard × tp = world size), resolves the one -1,
and builds the device mesh, like torchtitan's. Ranks follow the mesh order (pp, dp_replicate, dp_shard, tp):
consecutive ranks share a TP group, which keeps TP traffic inside a node; pp is outermost, so a stage's
point-to-point sends are the only traffic that crosses the widest distance (they are the smallest).
"""

from __future__ import annotations

import faulthandler
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llmcluster.config.job import FLIGHT_RECORDER_FILES
from llmcluster.config.schema import JobConfig
from llmcluster.distributed import HOST_RANKS_ENV
from llmcluster.distributed.cpu_memory import keep_freed_memory
from llmcluster.errors import UserError
from llmcluster.testing import test_hook

# Test hook (acts only with LLMCLUSTER_TESTING=1): run fp16 on a CPU without native fp16, emulated and slow,
# so that the fp16 paths (GradScaler, loss scaling under PP) are exercised where no GPU is.
FORCE_CPU_FP16 = "LLMCLUSTER_TEST_FORCE_CPU_FP16"


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    writer: bool = True   # False in a replica group other than the writer (ft/group.py): rank 0 writes nothing

    @property
    def is_main(self) -> bool:
        return self.rank == 0 and self.writer

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    fsdp_requested: bool  # dp_shard was not 1 in the config: shard even at degree 1 (FSDP on one GPU)
    pp: int = 1
    pp_schedule: str = "1F1B"
    virtual_stages: int = 1

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        p = cfg.parallel
        r, s, t, q = p.dp_replicate, p.dp_shard, p.tp, p.pp
        known = (r if r > 0 else 1) * (s if s > 0 else 1) * t * q
        names = f"parallel.pp={q} × " if q > 1 else ""
        names += f"parallel.dp_replicate={r} × parallel.dp_shard={s} × parallel.tp={t}"
        if world_size % known:
            raise UserError(f"{names} does not divide the world size {world_size}")
        rest = world_size // known
        if r == -1:
            r = rest
        elif s == -1:
            s = rest
        elif rest != 1:
            raise UserError(f"{names} = {known} but the world size is {world_size} "
                            "(set one of them to -1 to take the rest)")
        if t > 1 and r > 1 and s == 1:
            raise UserError("parallel.tp > 1 with plain replication is not supported: "
                            "use parallel.dp_shard for the data-parallel degree (FSDP × TP)")
        if q > 1 and r > 1 and s == 1 and t == 1:
            raise UserError("parallel.pp > 1 with plain replication (DDP) is not supported: "
                            "use parallel.dp_shard for the data-parallel degree (FSDP × PP)")
        if q > 1:
            m, v = cfg.train.grad_accum, p.virtual_stages
            if p.pp_schedule == "1F1B" and m < q:
                raise UserError(f"train.grad_accum ({m}) must be >= parallel.pp ({q}): 1F1B needs at least "
                                "one micro-batch per stage in flight")
            if p.pp_schedule == "interleaved_1F1B" and m % max(1, m // q):
                raise UserError(f"train.grad_accum ({m}) must be a multiple of grad_accum // parallel.pp "
                                f"({m // q}) for interleaved 1F1B (rounds of pp micro-batches)")
        return cls(r, s, t, world_size, fsdp_requested=p.dp_shard != 1, pp=q, pp_schedule=p.pp_schedule,
                   virtual_stages=p.virtual_stages if q > 1 else 1)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1 or self.fsdp_requested

    @property
    def ddp(self) -> bool:
        return not self.fsdp and self.dp_replicate > 1 and self.tp == 1

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp * self.tp)

    def build_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))

    @property
    def needs_group(self) -> bool:
        """A process group even at world size 1 (DTensor meshes need one)."""
        return self.fsdp or self.tp > 1 or self.pp > 1

    def describe(self) -> str:
        kind = "FSDP" if self.fsdp else ("DDP" if self.ddp else "single")
        if self.fsdp and self.dp_replicate > 1:
            kind = "HSDP"
        tp = f" × TP {self.tp}" if self.tp > 1 else ""
        pp = ""
        if self.pp > 1:
            pp = f" × PP {self.pp} {self.pp_schedule}"
            pp += f" ({self.virtual_stages} stages per rank)" if self.virtual_stages > 1 else ""
        return (f"{kind} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}{tp}{pp} "
                f"(world {self.world_size})")


def pick_device(cfg: JobConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available")
    if want in ("cuda", "auto") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        # TF32 tensor cores for fp32 matmuls (an fp32 run; the fp32 remainder of a bf16 one): PyTorch has left
        # them off by default since 1.12. "high" is TF32, "highest" full fp32 (the flag metrics.py reads).
        torch.set_float32_matmul_precision("high" if cfg.train.allow_tf32 else "highest")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


CPU_THREADS_ENV = "LLMCLUSTER_CPU_THREADS"


def cpu_threads_env() -> int | None:
    """$LLMCLUSTER_CPU_THREADS: a machine's cap on a CPU rank's threads where train.threads is unset (a shared or
    loaded host: make test sets 1, since with more processes than cores every small op of a rank with 2 threads
    waits for its other thread's turn on a core, which doubled a tiny run's CPU time and wall time, measured
    2026-12-08 on 2 cores under load). Not OMP_NUM_THREADS: torchrun sets that to 1 for every multi-rank launch,
    and a rank's share of the cores (cores / ranks on the host) is the better default there."""
    value = os.environ.get(CPU_THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"${CPU_THREADS_ENV}={value!r}: a number of threads, 1 or more")
    return int(value)


def init_distributed(cfg: JobConfig, need_group: bool = False) -> DistEnv:
    """Join the torchrun/Slurm process group if there is one (or make a world of 1 when asked)."""
    env = os.environ
    under_launcher = "RANK" in env and "WORLD_SIZE" in env
    rank = int(env.get("RANK", 0))
    world = int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(cfg, local_rank)
    if device.type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        # ranks sharing this host: the launch's own, or every ft group's where the local supervisor started them all
        on_host = max(local_world, int(env.get(HOST_RANKS_ENV, 0) or 0))
        torch.set_num_threads(cfg.train.threads or cpu_threads_env() or max(1, cores // on_host))
        keep_freed_memory()  # a step's large buffers reused, not faulted in again (cpu_memory.py says why)
    if device.type == "cuda":
        crash_dumps(rank)
    if under_launcher or need_group:
        backend = cfg.dist.backend
        if backend == "auto":
            # CPU tensors (flags, timings) travel over gloo even in a CUDA job.
            backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=cfg.dist.timeout_s)
        if under_launcher:
            dist.init_process_group(backend=backend, timeout=timeout, store=_attempt_store(timeout),
                                    rank=rank, world_size=world,
                                    device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        _make_control_group()
    return DistEnv(rank, world, local_rank, local_world, device)


def crash_dumps(rank: int) -> None:
    """Where the launcher asked for flight-recorder dumps (GPU jobs), make their directory (torch does not)
    and have faulthandler append this rank's Python stacks beside them when the process dies of a signal:
    the NCCL watchdog's SIGABRT runs no Python, so this and the dump are all that tell where the rank was."""
    for where in {os.path.dirname(os.environ[k]) or "." for k in FLIGHT_RECORDER_FILES if os.environ.get(k)}:
        try:
            os.makedirs(where, exist_ok=True)
            stacks = open(os.path.join(where, f"python_rank_{rank}.txt"), "a")  # noqa: SIM115 (lives with us)
        except OSError as e:  # only the post-mortem is lost: not a reason to refuse the run
            print(f"warning: no flight recorder dumps: cannot write to {where}: {e}", file=sys.stderr)
            continue
        faulthandler.enable(file=stacks, all_threads=True)
        _KEEP_OPEN.append(stacks)


_KEEP_OPEN: list = []  # faulthandler writes to the file's descriptor: it must stay open


def _attempt_store(timeout: timedelta):
    """torchrun keeps one store across restarts of the worker group: without a per-attempt prefix a
    restarted rank can read a dead rank's gloo address from the previous attempt ("Connection refused")."""
    env = os.environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    # The prefix must be the same on every rank. TORCHELASTIC_RESTART_COUNT is not: when one rank dies
    # only its agent counts a restart, the others restart on the membership change without counting, and
    # ranks with different prefixes wait for each other forever. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # (launch sets it) each round's store is new (rank 0 hosts it), so no prefix is needed at all.
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0") if shared else "0"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                          is_master=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and env["RANK"] == "0",
                          timeout=timeout)
    return dist.PrefixStore(f"llmcluster/attempt_{attempt}", store)


_control: list = [None]  # the gloo group of the control collectives, when the default group has no CPU backend


def _make_control_group() -> None:
    """The small control collectives (stop flags, timings, verdicts) all-reduce CPU tensors. With
    `dist.backend: nccl` the default group has no CPU backend and they would fail after step 1, so they get a
    gloo side group of their own (every rank calls this: new_group is collective). A default group that
    already has a CPU backend (gloo, "cuda:nccl,cpu:gloo") serves them itself."""
    _control[0] = None
    if "cpu:" not in dist.get_backend_config():
        _control[0] = dist.new_group(backend="gloo")


def control_group():
    """The group for CPU-tensor collectives (None: the default group)."""
    return _control[0] if dist.is_available() and dist.is_initialized() else None


# Whether this process tore a process group down: the CLI then leaves without interpreter finalization,
# where gloo's worker threads can still release tensors that need the GIL and abort the process (SIGABRT,
# "terminate called without an active exception": once in a 4-rank FSDP run under load, after barrier and
# destroy; pytorch/pytorch#179291 describes the mechanism). A launcher counts that abort as a failure.
torn_down = [False]


def shutdown(barrier: bool = True, teardown_timeout_s: float = 120.0) -> None:
    """barrier + destroy: without the barrier gloo aborts at exit in ~1 of 3 runs (torch-cpu-notes), and on
    torch 2.6 a bare destroy hung one rank in ~1 of 5 runs. The barrier runs on the control group, which
    takes CPU work whatever `dist.backend` is; `barrier=False` when a peer may be gone (it would hang).

    The barrier makes the hang rare, not impossible (CI saw it once more after a DTensor test), and a rank
    stuck in teardown holds its nodes until the job's time limit. So the destroy runs under a watchdog in C
    (faulthandler: it needs no GIL, which a stuck C++ destructor may hold): after `teardown_timeout_s` the
    process prints its stack and exits with status 1. A requeue of a finished run then exits at once."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    torn_down[0] = True
    try:
        if barrier:
            dist.barrier(group=control_group())
    finally:
        out = _real_stderr()
        if out is not None:
            faulthandler.dump_traceback_later(teardown_timeout_s, exit=True, file=out)
        try:
            dist.destroy_process_group()
        finally:
            if out is not None:
                faulthandler.cancel_dump_traceback_later()
            _control[0] = None


def _real_stderr():
    """A stderr with a file descriptor, which faulthandler writes to (a captured or redirected sys.stderr,
    as under pytest or a notebook, has none): the process's own, else none (no watchdog then)."""
    for f in (sys.stderr, sys.__stderr__):
        try:
            f.fileno()
            return f
        except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both of the last two
            continue
    return None


def all_reduce_max(value: float, env: DistEnv) -> float:
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group())
    return float(t.item())


def gather_floats(value: float, env: DistEnv) -> list[float]:
    """Every rank's value, on every rank (a one-hot all-reduce: works on gloo and NCCL alike)."""
    if not env.distributed:
        return [value]
    t = torch.zeros(env.world_size, dtype=torch.float64)
    t[env.rank] = value
    dist.all_reduce(t, group=control_group())
    return t.tolist()


def native_low_precision(device: torch.device, precision: str) -> bool:
    """Whether `precision` runs natively here. On CPUs without avx512_bf16/amx (e.g. AVX2-only parts),
    bf16 matmuls are emulated and ~50x slower than fp32: better to compute in fp32 and say so. The CPU's flags
    are not enough: torch's kernels run at the capability its dispatcher chose (ATEN_CPU_CAPABILITY caps it) and
    oneDNN's matmuls at its own (ONEDNN_MAX_CPU_ISA), and a cap below AVX-512 emulates bf16 whatever the CPU
    has. Honouring the caps is also how an AVX-512 machine stands in for an AVX2 one (`make test-avx2`)."""
    if precision == "fp32" or device.type == "cuda":
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    if precision == "bf16":
        return ("avx512_bf16" in flags or "amx_bf16" in flags) and _dispatch_allows("BF16")
    # the hook first: set, it says so on stderr even where the CPU has fp16 anyway (avx512_fp16 parts)
    return test_hook(FORCE_CPU_FP16) == "1" or (("avx512_fp16" in flags or "amx_fp16" in flags)
                                                 and _dispatch_allows("FP16"))


def _dispatch_allows(kind: str) -> bool:
    """Whether torch's CPU dispatch and oneDNN's ISA cap both leave the native `kind` (BF16|FP16) kernels on."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    # oneDNN's ISA names in order: SSE41 < AVX < AVX2 [_VNNI[_2]] < AVX512_CORE [_VNNI|_BF16] < AVX10_1_512
    # (its FP16) < ... _AMX ...: bf16 from _BF16 up, fp16 from AVX10_1_512 (AVX512_CORE_FP16) up
    if kind == "BF16":
        return isa in ("ALL", "DEFAULT") or "BF16" in isa or "FP16" in isa or "AMX" in isa or "AVX10" in isa
    return isa in ("ALL", "DEFAULT") or "FP16" in isa or "AVX10" in isa


def precision_note(device: torch.device, precision: str) -> str:
    """Which precision a run on `device` computes in, and why (the demo says it before training)."""
    if device.type == "cuda" or precision == "fp32":
        return f"{precision}: as configured"
    kind = "bf16" if precision == "bf16" else "fp16"
    flags = f"avx512_{kind} or amx_{kind}"
    if native_low_precision(device, precision):
        return (f"{precision}: this CPU has native {kind} ({flags}): autocast runs the matmuls in {kind}, "
                "while weights, optimizer state and the loss stay fp32")
    try:
        has = any(f in open("/proc/cpuinfo").read() for f in (f"avx512_{kind}", f"amx_{kind}"))
    except OSError:
        has = False
    why = (f"torch's CPU kernels are capped at {torch.backends.cpu.get_cpu_capability()} (ATEN_CPU_CAPABILITY, "
           "ONEDNN_MAX_CPU_ISA)") if has and not _dispatch_allows(kind.upper()) else f"this CPU has no {flags}"
    return f"fp32: {why}, so {precision} would be emulated (about 50x slower than fp32); computing in fp32"


def resolve_precision(cfg: JobConfig, env: DistEnv) -> str:
    """Set cfg.train.precision to what will really run here (fp32 where bf16/fp16 would be emulated)."""
    if not native_low_precision(env.device, cfg.train.precision):
        if env.is_main:
            print("precision " + precision_note(env.device, cfg.train.precision), file=sys.stderr)
        cfg.train.precision = "fp32"
    return cfg.train.precision
