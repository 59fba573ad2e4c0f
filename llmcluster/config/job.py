"""The `job` section: how a run is placed on the cluster (nodes, GPUs, scheduler settings).

Owned by the launch capability; the trainer ignores it. Every value that ends up in an `#SBATCH` line or a
Kubernetes name is checked here against a strict pattern, because those are parsed by the scheduler, not
by a shell, and cannot be quoted: a hostile value is refused with one line before anything is rendered.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from llmcluster.render import ENV_NAME, has_line_break, show_value

# Slurm accepts MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; we take the two unambiguous forms.
# Every grammar here is ASCII ([0-9], not \d: `\d` also matches '٥', which Slurm and Kubernetes do not read as a
# digit) and is applied with fullmatch (`$` would let a trailing newline through).
TIME_RE = re.compile(r"(?:([0-9]+)-)?([0-9]{1,3}):([0-5][0-9]):([0-5][0-9])", re.ASCII)
MEM_RE = re.compile(r"[0-9]+[KMGT]?", re.ASCII)           # Slurm --mem / converted to a k8s quantity
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", re.ASCII)  # partitions, queues, namespaces, claims
IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}", re.ASCII)  # registry/repo:tag@sha256:...
ENV_KEY_RE = ENV_NAME
PATH_RE = re.compile(r"/[A-Za-z0-9._/+-]*", re.ASCII)     # mount paths: absolute, no spaces or quotes
SHM_RE = re.compile(r"[0-9]+(Ki|Mi|Gi|Ti)?", re.ASCII)

# The NCCL environment presets. `default` is what every multi-node job wants: warnings only, and a
# collective that hangs or fails tears the process group down (instead of hanging until the time limit).
NCCL_PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    "default": {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
    # InfiniBand / RoCE data path; bootstrap over any interface but loopback and docker bridges
    "infiniband": {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                   "NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "^lo,docker"},
    # plain TCP sockets (no RDMA NIC)
    "ethernet": {"NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                 "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "^lo,docker"},
    # bring-up: who talks to whom over which transport
    "debug": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
              "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
}


# The CUDA allocator on GPU jobs: expandable segments grow one mapping instead of caching fixed blocks, so
# batches of varying shape (packed documents, the last micro-batch, eval) do not fragment the cache into
# OOMs at a fraction of the memory in use (torchtitan and Megatron runs set it). job.env may override it.
CUDA_ALLOC_PRESET: dict[str, str] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}

# NCCL's flight recorder on GPU jobs: a ring of the last collectives per rank, written out when the watchdog
# finds one past dist.timeout_s, before it aborts the process (SIGABRT: no Python runs after, so this dump is
# what tells which rank and collective hung; docs/fault-tolerance.md). Both names of each variable: torch
# 2.6 reads the TORCH_NCCL_ ones, later torch the TORCH_FR_ ones first. The dump path is per run
# (`LaunchSpec.rank_env`, FLIGHT_RECORDER_DIR under logs/<run>/).
FLIGHT_RECORDER_BUFFER = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FLIGHT_RECORDER_FILES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FLIGHT_RECORDER_DIR = "flight_recorder"


def time_to_seconds(value: str) -> int:
    m = TIME_RE.fullmatch(value)
    if not m:
        raise ValueError(f"job.time {show_value(value)} must be HH:MM:SS or D-HH:MM:SS")
    d, h, mi, s = (int(x or 0) for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def _match(regex: re.Pattern, prefix: str, allowed: str):
    """A field validator: the value must match `regex`; the error names the key and what is allowed."""
    def check(cls, v, info):
        if v is not None and not regex.fullmatch(v):
            raise ValueError(f"{prefix}{info.field_name} {show_value(v)} is not allowed: {allowed}")
        return v
    return classmethod(check)


NAME_CHARS = "letters, digits, '.', '_', '-' (at most 63)"
PATH_CHARS = "an absolute path of letters, digits and ._/+- (no spaces, quotes or newlines)"


def _host_path(p: str) -> str:
    if not PATH_RE.fullmatch(p) or p.rstrip("/") == "" or ".." in p.split("/"):
        raise ValueError(f"scheduler.kubernetes.host_paths {show_value(p)}: {PATH_CHARS}, not / itself")
    return p


HostPath = Annotated[str, AfterValidator(_host_path)]   # a prefix the cluster allows job.mounts under (ro)

# job.env names that carry secrets: whole underscore-separated words (HF_TOKEN, AWS_SECRET_ACCESS_KEY), so
# TOKENIZERS_PARALLELISM and NCCL_IB_PKEY are not. Their values belong in job.secret_env, never in a file.
SECRET_WORDS = {"TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD"}
SECRET_ADVICE = ("list its name in job.secret_env instead (passed from the submitting environment or the Kubernetes "
                 "Secret, never written to a file)")
# A value that carries a credential whatever its key is called: a URL's user:password@ (or token@), or a
# key=value / key: value pair whose key ends in a secret word, as a whole word (password=..., api_token: ...,
# ?secret=...; not monkey=1). Both scans are linear (a 100k-character value must not take minutes).
_NETLOC_END = re.compile(r"[/?#\s]")
_SECRET_PAIR = re.compile(r"(?<![A-Za-z0-9])(token|key|secret|password|passwd|credentials?)[ \t]*[=:][ \t]*[^\s&;,]",
                          re.ASCII | re.IGNORECASE)


def credential_in(value: str) -> str | None:
    """What in `value` looks like a credential (for the error line, never the secret itself), or None."""
    for m in re.finditer("://", value):
        end = _NETLOC_END.search(value, m.end())
        if "@" in value[m.end():end.start() if end else len(value)]:
            return "user:password@ in a URL"   # or a bare token@: both are sent as credentials
    if m := _SECRET_PAIR.search(value):
        return f"a {m.group(1).lower()}= pair"
    return None


class Mount(BaseModel):
    """A host (or shared filesystem) path made visible inside the container at `path`."""
    model_config = ConfigDict(extra="forbid")
    source: str
    path: str
    read_only: bool = False

    _paths = field_validator("source", "path")(_match(PATH_RE, "job.mounts.", PATH_CHARS))


AREAS = ("datasets", "checkpoints", "logs", "models")   # what a pod mounts of the storage root


class Claim(BaseModel):
    """One storage area on its own PersistentVolumeClaim (the area is the claim's root directory)."""
    model_config = ConfigDict(extra="forbid")
    claim: str
    read_only: bool = False

    _claim = field_validator("claim")(_match(NAME_RE, "job.k8s.claims.", NAME_CHARS))


class K8sSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kind: Literal["indexed-job", "volcano", "jobset", "pytorchjob"] = "indexed-job"
    namespace: str = "default"
    # The site's storage and service account come from the cluster spec (storage.kubernetes,
    # scheduler.kubernetes: launch/cluster_defaults.py); a job config may set them on a cluster without one.
    # One PVC for every area (sub-paths datasets/, checkpoints/...), or a PVC per area in `claims`; with
    # `claims` given, areas without a claim are not on a PVC unless storage_claim is set explicitly.
    storage_claim: str | None = "llmcluster-storage"
    claims: dict[Literal["datasets", "checkpoints", "logs", "models"], Claim] = {}
    storage_path: str = "/storage"              # where it is mounted in the pods (= run.storage there)
    queue: str | None = None                    # Volcano queue / Kueue local queue
    service_account: str | None = None          # None: no API token is mounted into the pods
    secret_name: str = "llmcluster-secrets"     # the Secret holding job.secret_env (one key per name)
    run_as_user: int = Field(10000, ge=1)       # never root; above host UIDs (checkov CKV_K8S_40)
    shm_size: str = "16Gi"                      # memory-backed /dev/shm for dataloader workers and NCCL
    rdzv_port: int = Field(29500, ge=1024, le=65535)
    # From the cluster spec (scheduler.kubernetes) unless the job says otherwise:
    node_selector: dict[str, str] = {}
    tolerations: list[dict] = []

    _ns = field_validator("namespace", "storage_claim", "queue", "service_account", "secret_name")(
        _match(NAME_RE, "job.k8s.", NAME_CHARS))
    _sp = field_validator("storage_path")(_match(PATH_RE, "job.k8s.", PATH_CHARS))

    @model_validator(mode="after")
    def _claims_replace_the_shared_one(self):
        if self.claims and "storage_claim" not in self.model_fields_set:
            self.__dict__["storage_claim"] = None   # the cluster named its claims: no implicit shared one
        return self

    @field_validator("shm_size")
    @classmethod
    def _shm(cls, v):
        if not SHM_RE.fullmatch(v):
            raise ValueError(f"job.k8s.shm_size {show_value(v)} must be a quantity like 16Gi")
        return v


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)          # 0 = CPU
    procs_per_node: int | None = Field(None, ge=1)  # None: = GPUs, or 1 on CPU
    cpus_per_node: int | None = Field(None, ge=1)
    mem_per_node: str | None = None              # e.g. "480G" (Slurm units; K/M/G/T)
    time: str = "72:00:00"
    partition: str | None = None                 # Slurm partition
    account: str | None = None                   # Slurm account
    image: str | None = None                     # container image (pyxis on Slurm; required on k8s)
    mounts: list[Mount] = []                     # extra container mounts (storage is always mounted)
    nccl: Literal["none", "default", "infiniband", "ethernet", "debug"] = "default"
    env: dict[str, str] = {}                     # extra environment, applied after the NCCL and CUDA presets
    # names of secrets (HF_TOKEN, WANDB_API_KEY) passed from the submitting environment (Slurm, local) or
    # the Kubernetes Secret job.k8s.secret_name: their values are never rendered, logged or saved
    secret_env: list[str] = []
    max_restarts: int = Field(3, ge=0)           # torchrun --max-restarts: a crashed rank restarts the group
    max_requeues: int = Field(3, ge=0)           # requeues after a preemption, time limit or runtime failure
    signal_before_s: int = Field(300, ge=10)     # SIGUSR2 this long before the time limit: checkpoint now
    rdzv_port: int = Field(29500, ge=1024, le=65535)  # c10d store: Slurm takes the first free port from here
    k8s: K8sSpec = K8sSpec()

    _time = field_validator("time")(classmethod(lambda cls, v: (time_to_seconds(v), v)[1]))
    _mem = field_validator("mem_per_node")(_match(MEM_RE, "job.", "a number with an optional K/M/G/T unit"))
    _names = field_validator("partition", "account")(_match(NAME_RE, "job.", NAME_CHARS))
    _image = field_validator("image")(_match(IMAGE_RE, "job.", "an image reference (registry/repo:tag)"))

    @field_validator("env", mode="before")
    @classmethod
    def _env_scalars(cls, v):
        # YAML and --set read `NCCL_IB_TIMEOUT: 22` as a number; the environment is text either way
        if isinstance(v, dict):
            return {k: str(x).lower() if isinstance(x, bool) else str(x) if isinstance(x, (int, float)) else x
                    for k, x in v.items()}
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        for key, val in v.items():
            if not ENV_KEY_RE.fullmatch(key):
                raise ValueError(f"job.env key {show_value(key)} is not a valid environment variable name")
            if has_line_break(val):
                raise ValueError(f"job.env.{key}: a newline, carriage return, other line break or NUL is not allowed")
            if SECRET_WORDS & set(key.upper().split("_")):
                raise ValueError(f"job.env.{key} looks like a secret: {SECRET_ADVICE}")
            if why := credential_in(val):
                raise ValueError(f"job.env.{key} holds a credential ({why}): {SECRET_ADVICE}")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secrets(cls, v, info):
        for key in v:
            if not ENV_KEY_RE.fullmatch(key):
                raise ValueError(f"job.secret_env name {show_value(key)} is not a valid environment variable name")
        if set(v) & set(info.data.get("env", {})):
            raise ValueError(f"job.secret_env names {sorted(set(v) & set(info.data['env']))} are also in job.env")
        return v

    @property
    def procs(self) -> int:
        """Processes per node: explicit, else one per GPU, else one (CPU)."""
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs

    @property
    def time_s(self) -> int:
        return time_to_seconds(self.time)

    def environment(self) -> dict[str, str]:
        gpu = {**CUDA_ALLOC_PRESET, **self.preset_unless_set(FLIGHT_RECORDER_BUFFER, "2000"),
               "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"} if self.gpus_per_node else {}
        return {**gpu, **NCCL_PRESETS[self.nccl], **self.env}

    def preset_unless_set(self, names: tuple[str, ...], value: str) -> dict[str, str]:
        """`value` under every name of one setting, unless job.env sets it under any of them (a torch that
        reads the newer name first would otherwise prefer our preset to the user's older name)."""
        return {} if any(n in self.env for n in names) else dict.fromkeys(names, value)


REDACTED = "<redacted>"


def redact_job(job: dict) -> dict:
    """A dumped job section as it may be saved: job.env values replaced (they may hold tokens)."""
    return {**job, "env": {k: REDACTED for k in job.get("env", {})}}
