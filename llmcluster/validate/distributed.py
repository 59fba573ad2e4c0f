"""Where this process sits in a multi-rank validate run, and how such a run is started.

`llmcluster validate` runs three ways:
  * under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set by torchrun);
  * under srun, one task per GPU (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR/MASTER_PORT
    exported by the batch script, or derived here: the first host of SLURM_JOB_NODELIST and a port
    from the job id, the convention of most Slurm launchers);
  * alone: the per-node checks run in this process; `collectives` starts `--nproc` local ranks with
    `torchrun --standalone -m llmcluster validate collectives ...` and reads back rank 0's JSON.
No torch at import: the CLI imports this to decide which way it runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host: str = socket.gethostname()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def label(self) -> str:
        """What a per-device result is named by in the cross-node tables."""
        return f"{self.host}:{self.local_rank}" if self.distributed else self.host


def current_place(environ=os.environ) -> Place:
    host = environ.get("SLURMD_NODENAME") or socket.gethostname()
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return Place(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                     int(environ.get("LOCAL_RANK", 0)), host)
    if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        return Place(int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]),
                     int(environ.get("SLURM_LOCALID", 0)), host)
    return Place(host=host)


def slurm_rendezvous(environ=os.environ) -> dict[str, str]:
    """The env torch's env:// init needs, filled in from SLURM_* where torchrun did not set it."""
    env = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
           "LOCAL_RANK": environ.get("SLURM_LOCALID", "0")}
    if "MASTER_ADDR" not in environ:
        env["MASTER_ADDR"] = first_host(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""))
    if "MASTER_PORT" not in environ:
        env["MASTER_PORT"] = str(15000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000)
    return env


def first_host(nodelist: str) -> str:
    """'node[03-05,07],gpu1' -> 'node03' (scontrol when present, a small parser otherwise)."""
    if not nodelist:
        return "127.0.0.1"
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=10).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    from llmcluster.config.hostlist import expand_hostlist
    from llmcluster.errors import UserError

    try:
        return expand_hostlist(nodelist)[0]
    except UserError:
        return nodelist.split(",")[0]


def init_process_group():
    """Initialise torch.distributed for this rank (NCCL if it has a GPU, else gloo); returns the device."""
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.update(slurm_rendezvous())
    place = current_place()
    if torch.cuda.is_available():
        device = torch.device("cuda", place.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def shutdown() -> None:
    """The trainer's teardown (barrier, then a destroy under a watchdog): with gloo the barrier avoids the
    random SIGABRT at exit (torch-cpu-notes), the watchdog torch 2.6's rare hang in destroy."""
    from llmcluster.distributed.process_groups import shutdown as train_shutdown

    train_shutdown()


def spawn_local(nproc: int, cli_args: list[str], env: dict | None = None,
                timeout: float | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m llmcluster ARGS` on this node: this same command as
    ranks of a job. Output streams through (rank 0 prints progress); the caller reads the results from
    the JSON file it named in ARGS.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "llmcluster", *cli_args]
    full_env = dict(os.environ, **(env or {}))
    # one intra-op thread per rank unless asked otherwise: N ranks on a few cores must not oversubscribe
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.pop("RANK", None)
    return subprocess.run(cmd, env=full_env, timeout=timeout)

