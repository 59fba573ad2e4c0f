"""Process-group setup from the torchrun (or Slurm) environment, and the one mesh of the run.

`ParallelDims` holds the degrees (dp_replicate × dp_shard × tp = world size), resolves the one -1, and
builds the device mesh, like torchtitan's. Data-parallel rank/size follow from the mesh order
(dp_replicate, dp_shard, tp): consecutive ranks share a TP group, which keeps TP traffic inside a node.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

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

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> ParallelDims:
        p = cfg.parallel
        r, s, t = p.dp_replicate, p.dp_shard, p.tp
        known = (r if r > 0 else 1) * (s if s > 0 else 1) * t
        if world_size % known:
            raise UserError(
                f"parallel.dp_replicate={r} × parallel.dp_shard={s} × parallel.tp={t} does not divide "
                f"the world size {world_size}")
        rest = world_size // known
        if r == -1:
            r = rest
        elif s == -1:
            s = rest
        elif rest != 1:
            raise UserError(
                f"parallel.dp_replicate={r} × parallel.dp_shard={s} × parallel.tp={t} = {known} "
                f"but the world size is {world_size} (set one of them to -1 to take the rest)")
        if t > 1 and r > 1 and s == 1:
            raise UserError("parallel.tp > 1 with plain replication is not supported: "
                            "use parallel.dp_shard for the data-parallel degree (FSDP × TP)")
        return cls(r, s, t, world_size, fsdp_requested=p.dp_shard != 1)

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
        return rank // self.tp

    def build_mesh(self, device_type: str):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    def describe(self) -> str:
        kind = "FSDP" if self.fsdp else ("DDP" if self.ddp else "single")
        if self.fsdp and self.dp_replicate > 1:
            kind = "HSDP"
        tp = f" × TP {self.tp}" if self.tp > 1 else ""
        return f"{kind} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}{tp} (world {self.world_size})"


def pick_device(cfg: JobConfig, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available")
    if want in ("cuda", "auto") and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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
        torch.set_num_threads(cfg.train.threads or max(1, cores // local_world))
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
    return DistEnv(rank, world, local_rank, local_world, device)


def _attempt_store(timeout: timedelta):
    """torchrun keeps one store across restarts of the worker group: without a per-attempt prefix a
    restarted rank can read a dead rank's gloo address from the previous attempt ("Connection refused")."""
    env = os.environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                          is_master=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and env["RANK"] == "0",
                          timeout=timeout)
    return dist.PrefixStore(f"llmcluster/attempt_{attempt}", store)


def shutdown() -> None:
    """barrier + destroy: without the barrier gloo aborts at exit in ~1 of 3 runs (torch-cpu-notes)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def all_reduce_max(value: float, env: DistEnv) -> float:
    if not env.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def gather_floats(value: float, env: DistEnv) -> list[float]:
    """Every rank's value, on every rank (a one-hot all-reduce: works on gloo and NCCL alike)."""
    if not env.distributed:
        return [value]
    t = torch.zeros(env.world_size, dtype=torch.float64)
    t[env.rank] = value
    dist.all_reduce(t)
    return t.tolist()


def native_low_precision(device: torch.device, precision: str) -> bool:
    """Whether `precision` runs natively here. On CPUs without avx512_bf16/amx (e.g. AVX2-only parts),
    bf16 matmuls are emulated and ~50x slower than fp32: better to compute in fp32 and say so."""
    if precision == "fp32" or device.type == "cuda":
        return True
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    if precision == "bf16":
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return "avx512_fp16" in flags or "amx_fp16" in flags


def resolve_precision(cfg: JobConfig, env: DistEnv) -> str:
    """Set cfg.train.precision to what will really run here (fp32 where bf16/fp16 would be emulated)."""
    if not native_low_precision(env.device, cfg.train.precision):
        if env.is_main:
            print(f"warning: train.precision={cfg.train.precision} is emulated on this CPU (no native "
                  f"support): computing in fp32", file=sys.stderr)
        cfg.train.precision = "fp32"
    return cfg.train.precision
