"""The cluster spec (cluster.yaml): the one description of the cluster that plan, validate, launch and monitor read.

Minimal shape (the keys tests and users rely on):

    name: seed
    nodes: {hosts: "gpu[01-08]"}        # or {count: 8}; per-node overrides allowed
    hardware: {gpu: A100-80GB, gpus_per_node: 4, cpus_per_node: 64, memory_gb: 512, fabric: ib-ndr, nics_per_node: 4}
    storage:
      root: /storage
      kubernetes: {datasets: {claim: datasets-pvc, read_only: true}, checkpoints: {claim: checkpoints-pvc}}
    scheduler:
      slurm: {partition: gpu}
      kubernetes: {namespace: llm, image: registry.example.com/llmcluster:0.1}

Every section forbids unknown keys. `hardware.gpu: none` with `gpus_per_node: 0` is a CPU-only cluster; the
built-in default (no file anywhere) is one such local node. Loading and resolution live in `cluster_load`;
every key, its default and its readers are listed in docs/cluster.md.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmcluster.config.gpus import FABRICS as FABRIC_TABLE, GPUSpec, gpu_spec
from llmcluster.config.hostlist import HOST_CHARS, HOST_RE, HOSTLIST_RE, expand_hostlist
from llmcluster.config.job import IMAGE_RE, NAME_CHARS, NAME_RE, PATH_CHARS, PATH_RE, HostPath, _match
from llmcluster.errors import UserError
from llmcluster.render import show_value

# = storage.layout.AREAS (config imports no capability; tests/test_cluster.py keeps the two equal)
AREAS = ("datasets", "checkpoints", "logs", "models", "scratch")
# Inter-node fabrics: the RDMA ones of the GPU/fabric table (config/gpus.py), TCP sockets (`ethernet`, no published
# figure: the planner refuses it across nodes) and `none` (one node).
FABRICS = ("ib-hdr", "ib-ndr", "roce-200", "roce-400", "ethernet", "none")
assert set(FABRICS) == set(FABRIC_TABLE) | {"ethernet"}
CPU_ONLY = "none"
# Every string of the spec reaches a file another program parses (slurm.conf, topology.conf, an Ansible var, a
# shell script run as root, a systemd unit, prometheus.yml): each is held to a grammar here, whatever the
# scheduler, and the renderers quote or escape on top (docs/security.md).
REL_PATH_RE = re.compile(r"[A-Za-z0-9._+][A-Za-z0-9._/+-]*", re.ASCII)      # a local storage root may be relative
# Prometheus durations (units in this order, as Prometheus parses them): 15s, 1m30s, 500ms
# ([0-9], not \d: `1٥s` is no duration to Prometheus; every grammar of the spec is ASCII and fullmatched)
DURATION_RE = re.compile(r"(?:[0-9]+y)?(?:[0-9]+w)?(?:[0-9]+d)?(?:[0-9]+h)?(?:[0-9]+m)?(?:[0-9]+s)?(?:[0-9]+ms)?",
                         re.ASCII)
# Kubernetes label keys ([prefix/]name) and values
LABEL_KEY_RE = re.compile(r"(?:[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?",
                          re.ASCII)
LABEL_VALUE_RE = re.compile(r"(?:[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?", re.ASCII)


def check_storage_root(root: str, absolute_for: str | None = None) -> str:
    """The one path rule for storage.root, whatever the scheduler: it reaches shell scripts run as root,
    systemd units and Ansible, so no spaces, quotes, newlines, `%` or `$`; and absolute (`absolute_for`
    says why) wherever machines other than this one mount it."""
    if not (PATH_RE.fullmatch(root) or REL_PATH_RE.fullmatch(root)):
        raise ValueError(f"storage.root {show_value(root)} is not allowed: a path of letters, digits and ._/+- "
                         "(no spaces, quotes, newlines, % or $)")
    if absolute_for and not root.startswith("/"):
        raise ValueError(f"storage.root {show_value(root)} must be {PATH_CHARS} {absolute_for}")
    return root


def is_duration(value: str) -> bool:
    """A positive Prometheus duration."""
    return bool(value) and bool(DURATION_RE.fullmatch(value)) and any(c in "123456789" for c in value)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _pattern(regex, allowed: str):
    return _match(regex, "", allowed)


class NodeOverride(Section):
    """Values that differ on some nodes (a node with fewer working GPUs, a bigger head node)."""
    gpus_per_node: int | None = Field(None, ge=0)
    cpus_per_node: int | None = Field(None, ge=1)
    memory_gb: float | None = Field(None, gt=0)


def _hostlist_names(expr: str, what: str) -> list[str]:
    if not HOSTLIST_RE.fullmatch(expr):
        raise ValueError(f"{what} {show_value(expr)} is not a host name or Slurm hostlist: {HOST_CHARS}, "
                         "with [01-08,12] ranges and commas")
    names = expand_hostlist(expr)
    for name in names:
        if not HOST_RE.fullmatch(name):
            raise ValueError(f"{what} {show_value(expr)}: {show_value(name)} is not a host name ({HOST_CHARS})")
    return names


class Nodes(Section):
    hosts: str | list[str] | None = None        # Slurm hostlist "gpu[01-08]" or a list of names
    count: int | None = Field(None, ge=1)        # when the names are not known (planning) or do not matter
    overrides: dict[str, NodeOverride] = {}     # hostname or hostlist -> values that differ there

    @field_validator("hosts")
    @classmethod
    def _host_names(cls, v):
        """RFC 1123 names after expansion: a name becomes a NodeName= line, an inventory host and a scrape
        target, so a newline or a space would inject slurmctld directives or split a line."""
        for item in [v] if isinstance(v, str) else v or []:
            _hostlist_names(item, "nodes.hosts")
        return v

    @field_validator("overrides")
    @classmethod
    def _override_keys(cls, v):
        for key in v:
            _hostlist_names(key, "nodes.overrides key")
        return v

    @model_validator(mode="after")
    def _one_of(self):
        if self.hosts is not None and self.count is not None and self.count != len(self.names):
            raise ValueError(f"nodes.count ({self.count}) and nodes.hosts ({len(self.names)} hosts) disagree: "
                             "give one of them")
        known = set(self.names)
        for key in self.overrides:
            missing = [h for h in expand_hostlist(key) if h not in known]
            if missing:
                raise ValueError(f"nodes.overrides.{key}: {missing[0]} is not in nodes.hosts")
        return self

    @property
    def names(self) -> list[str]:
        if self.hosts is None:
            return []
        raw = [self.hosts] if isinstance(self.hosts, str) else self.hosts
        out: list[str] = []
        for item in raw:
            out.extend(expand_hostlist(item))
        return out

    @property
    def n(self) -> int:
        return len(self.names) if self.hosts is not None else (self.count or 1)


class Hardware(Section):
    gpu: str = CPU_ONLY                          # a GPU of config/gpus.py (A100-80GB, H100, H200, RTX4090, L40S) or none
    gpus_per_node: int | None = Field(None, ge=0)  # required with a GPU; 0 with gpu: none
    cpus_per_node: int | None = Field(None, ge=1)
    memory_gb: float | None = Field(None, gt=0)    # host memory per node
    fabric: Literal[FABRICS] = "none"              # inter-node network
    nics_per_node: int | None = Field(None, ge=1)  # None: one per GPU (rail-optimised)
    nic_GBps: float | None = Field(None, gt=0)     # achieved GB/s per NIC; None: the fabric's published figure
    intra_node: Literal["nvlink", "pcie"] | None = None      # None: NVLink if the GPU has it
    intra_node_busbw_GBps: float | None = Field(None, gt=0)  # achieved all-reduce busbw; None: the table's
    node_power_kw: float | None = Field(None, gt=0)  # server max draw; None: GPU TDP x Epoch AI's server factor
    gpu_reserved_gib: float = Field(1.0, ge=0)       # CUDA context, cuBLAS/NCCL workspaces (planning assumption)
    allocator_slack: float = Field(0.05, ge=0)       # caching-allocator fragmentation, share of allocated
    # The GPUs' host link as installed (None: the GPU table's, Gen4/Gen5 x16): what offload's transfers run at
    pcie_gen: int | None = Field(None, ge=3, le=6)
    pcie_lanes: Literal[1, 2, 4, 8, 16] | None = None

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        if v.strip().lower() in ("none", "cpu", ""):
            return CPU_ONLY
        try:
            return gpu_spec(v).name
        except UserError as e:
            raise ValueError(f"hardware.gpu: {e} (or none for a CPU-only cluster)") from None

    @model_validator(mode="after")
    def _gpus(self):
        if self.gpu == CPU_ONLY:
            if self.gpus_per_node:
                raise ValueError(f"hardware.gpus_per_node is {self.gpus_per_node} but hardware.gpu is none: "
                                 "name the GPU, or set gpus_per_node: 0 for a CPU-only cluster")
            self.gpus_per_node = 0
        elif self.gpus_per_node is None:
            raise ValueError(f"hardware.gpus_per_node is required with hardware.gpu {self.gpu}")
        elif self.gpus_per_node == 0:
            raise ValueError(f"hardware.gpus_per_node is 0 but hardware.gpu is {self.gpu}: use gpu: none for CPU-only")
        return self

    @property
    def spec(self) -> GPUSpec | None:
        return None if self.gpu == CPU_ONLY else gpu_spec(self.gpu)

    @property
    def nics(self) -> int:
        return self.nics_per_node or self.gpus_per_node or 1


class Topology(Section):
    """The inter-node network as the planner sizes it: a non-blocking rail-optimised fat-tree."""
    switch_radix: int = Field(64, ge=4)          # ports per switch (NVIDIA QM9700 NDR: 64)
    rails: int | None = Field(None, ge=1)        # independent leaf planes; None: = hardware.nics_per_node
    rack_kw: float = Field(40.0, gt=0)           # power budget per rack
    air_cooling_max_kw: float = Field(40.0, gt=0)  # above this per rack: liquid cooling
    intra_latency_us: float = Field(10.0, ge=0)  # per collective step inside a node (planning assumption)
    inter_latency_us: float = Field(20.0, ge=0)  # per collective step across nodes


class StorageArea(Section):
    """What backs one /storage area and what it is expected to deliver (aggregate, GB/s)."""
    backend: Literal["lustre", "weka", "gpfs", "nfs", "local"] | None = None   # None: storage.backend
    write_GBps: float | None = Field(None, gt=0)
    read_GBps: float | None = Field(None, gt=0)
    files_per_s: float | None = Field(None, gt=0)


class Claim(Section):
    """A PersistentVolumeClaim that holds one area on Kubernetes (mounted at <root>/<area>)."""
    claim: str
    read_only: bool = False
    _name = field_validator("claim")(_pattern(NAME_RE, NAME_CHARS))


class Storage(Section):
    root: str = "./storage"                  # the shared root; /storage on a cluster
    backend: Literal["lustre", "weka", "gpfs", "nfs", "local"] = "local"
    write_GBps: float | None = Field(None, gt=0)   # aggregate, every area unless it says otherwise
    read_GBps: float | None = Field(None, gt=0)
    areas: dict[Literal[AREAS], StorageArea] = {}
    kubernetes: dict[Literal[AREAS], Claim] = {}   # area -> PVC; areas without one are not mounted

    def area(self, name: str) -> StorageArea:
        """The area's figures with storage-wide values filled in where it gives none."""
        a = self.areas.get(name, StorageArea())
        return StorageArea(backend=a.backend or self.backend, write_GBps=a.write_GBps or self.write_GBps,
                           read_GBps=a.read_GBps or self.read_GBps, files_per_s=a.files_per_s)


class Slurm(Section):
    partition: str | None = None
    account: str | None = None
    image: str | None = None                 # container image run through pyxis (srun --container-image)
    head_node: str | None = None             # where sbatch runs (login/head node); descriptive

    _names = field_validator("partition", "account")(_pattern(NAME_RE, NAME_CHARS))
    _head = field_validator("head_node")(_pattern(HOST_RE, f"a host name ({HOST_CHARS})"))
    _image = field_validator("image")(_pattern(IMAGE_RE, "an image reference (registry/repo:tag)"))


class Kubernetes(Section):
    namespace: str = "default"
    image: str | None = None
    kind: Literal["indexed-job", "volcano", "jobset", "pytorchjob"] = "indexed-job"   # the default job form
    gang_scheduler: Literal["none", "volcano", "kueue"] = "none"
    queue: str | None = None                 # Volcano queue / Kueue local queue
    service_account: str | None = None
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []   # Kubernetes toleration objects, as written in a pod spec
    host_paths: list[HostPath] = []          # hostPath prefixes job.mounts may be under (mounted read-only)

    _names = field_validator("namespace", "queue", "service_account")(_pattern(NAME_RE, NAME_CHARS))
    _image = field_validator("image")(_pattern(IMAGE_RE, "an image reference (registry/repo:tag)"))

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not LABEL_KEY_RE.fullmatch(key) or not LABEL_VALUE_RE.fullmatch(value):
                raise ValueError(f"scheduler.kubernetes.node_selector {show_value(key)}: {show_value(value)} is not "
                                 "a Kubernetes "
                                 "label (letters, digits, '-', '_', '.'; at most 63, an optional prefix/)")
        return v

    @model_validator(mode="after")
    def _gang(self):
        if self.gang_scheduler == "volcano" and self.kind == "indexed-job":
            self.kind = "volcano"        # gang-scheduled by default where the cluster has Volcano
        return self


# SkyPilot's clouds this project renders for, and those that sell spot capacity (Lambda and a Kubernetes cluster
# do not: `use_spot` there is refused before sky is asked)
CLOUDS = ("lambda", "kubernetes", "aws", "gcp", "azure")
SPOT_CLOUDS = frozenset({"aws", "gcp", "azure"})


class Cloud(Section):
    """Where `launch --scheduler skypilot` rents the nodes (launch/skypilot.py renders it; docs/launch.md)."""
    provider: Literal[CLOUDS]
    region: str | None = None
    # candidate GPU sets, {table GPU: GPUs per node}; SkyPilot takes the cheapest it can get. Empty: hardware.gpu
    accelerators: dict[str, int] = {}
    use_spot: bool = False
    recovery: bool = False             # a managed job (`sky jobs launch`) even without spot
    max_restarts_on_errors: int = Field(0, ge=0)
    disk_size_gb: int | None = Field(None, ge=50)
    bucket: str | None = None          # where each sealed checkpoint step is copied (a path the nodes mount)

    _region = field_validator("region")(_pattern(NAME_RE, NAME_CHARS))
    _bucket = field_validator("bucket")(_pattern(PATH_RE, PATH_CHARS))

    @field_validator("accelerators")
    @classmethod
    def _known(cls, v: dict[str, int]) -> dict[str, int]:
        out = {}
        for name, count in v.items():
            try:
                gpu = gpu_spec(name).name
            except UserError as e:
                raise ValueError(f"cloud.accelerators: {e}") from None
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"cloud.accelerators.{name}: {count!r} is not a GPU count (1 or more)")
            out[gpu] = count
        return out

    @model_validator(mode="after")
    def _spot(self):
        if self.use_spot and self.provider not in SPOT_CLOUDS:
            raise ValueError(f"cloud.use_spot: {self.provider} has no spot instances (spot: {', '.join(sorted(SPOT_CLOUDS))})")
        return self


class Scheduler(Section):
    default: Literal["local", "slurm", "k8s", "skypilot"] = "local"
    slurm: Slurm = Slurm()
    kubernetes: Kubernetes = Kubernetes()


class Monitoring(Section):
    exporter_port: int = Field(9400, ge=1, le=65535)   # `monitor serve` on every node (dcgm-exporter's port)
    train_port: int = Field(9401, ge=1, le=65535)      # the port of the trainers' log.metrics_bind
    train_ports_per_node: int | None = Field(None, ge=1)  # None: one per GPU (one per local rank), 1 on CPU
    scrape_interval: str = "15s"
    namespace: str = "monitoring"                      # Kubernetes namespace of the exporter DaemonSet

    _ns = field_validator("namespace")(_pattern(NAME_RE, NAME_CHARS))

    @field_validator("scrape_interval")
    @classmethod
    def _duration(cls, v: str) -> str:
        if not is_duration(v):
            raise ValueError(f"monitoring.scrape_interval {show_value(v)} is not a Prometheus duration "
                             "(e.g. 15s, 1m30s)")
        return v


class Thresholds(Section):
    """validate's pass/warn fractions of the expected figures (the figures come from hardware and storage)."""
    tolerance: float = Field(0.10, gt=0, lt=1)   # a node this far below the median is an outlier
    compute_pass_at: float = Field(0.90, gt=0, le=1.5)   # bf16 matmul vs the MAMF figure
    compute_warn_at: float = Field(0.75, gt=0, le=1.5)
    memory_pass_at: float = Field(0.75, gt=0, le=1.5)    # device copy vs datasheet HBM bandwidth
    memory_warn_at: float = Field(0.60, gt=0, le=1.5)
    pcie_GBps: float | None = Field(None, gt=0)          # None: the GPU's achieved PCIe figure
    pcie_pass_at: float = Field(0.80, gt=0, le=1.5)
    pcie_warn_at: float = Field(0.50, gt=0, le=1.5)
    min_busbw_GBps: float | None = Field(None, gt=0)     # all_reduce busbw at the largest size; None: report only
    max_temp_c: float = Field(84, gt=0)                  # GCM/Imbue gate
    max_clock_drop: float = Field(0.10, gt=0, lt=1)


class Reliability(Section):
    # Per node; the job's MTBF is this / nodes. Default from Llama 3 (Dubey et al. 2024, arXiv 2407.21783,
    # section 3.3.4, Table 5): 419 unexpected interruptions in 54 days of pre-training on 16,384 H100s
    # (2,048 nodes of 8): 54 x 24 x 2048 / 419 = 6,335 node-hours (50,677 GPU-hours) between interruptions.
    node_mtbf_hours: float = Field(6_335.0, gt=0)
    restart_minutes: float = Field(15.0, ge=0)      # lost per failure: requeue, load, warm up


class Cost(Section):
    """Every price is optional: None takes it from the dated prices file (plan/data/prices.yaml)."""
    prices: str | None = None                 # path to a prices YAML; None: the bundled one
    cloud_usd_per_gpu_hour: float | None = Field(None, gt=0)
    server_usd: float | None = Field(None, gt=0)     # one node, without the network
    network_fraction: float | None = Field(None, ge=0, lt=1)  # network share of the cluster's cost
    power_usd_per_kwh: float | None = Field(None, gt=0)
    pue: float | None = Field(None, ge=1)
    maintenance_per_year: float | None = Field(None, ge=0)  # fraction of capex per year
    colocation_usd_per_kw_month: float | None = Field(None, ge=0)
    staff_usd_per_month: float | None = Field(None, ge=0)
    utilisation: float | None = Field(None, gt=0, le=1)      # busy fraction of the on-prem cluster
    server_life_years: float | None = Field(None, gt=0)
    api_usd_per_million_tokens: float | None = Field(None, gt=0)  # a cloud API's price: serving's alternative


# a package index: no spaces, quotes or shell characters
URL_RE = re.compile(r"https?://[A-Za-z0-9._~:/@+=-]+", re.ASCII)


class Provision(Section):
    """How `provision`'s ML level installs where the nodes may not reach the internet (docs/bring-up.md)."""
    wheel: str | None = None          # an llmcluster wheel here; None: `provision --wheel`, else built from the checkout
    torch_index: str | None = None    # pip index for torch; None: PyTorch's (cuXY on GPU nodes, cpu elsewhere)
    wheelhouse: str | None = None     # a directory of wheels every node reads: torch and llmcluster's dependencies
    #                                   from it alone (pip --no-index), no index reached

    _url = field_validator("torch_index")(_pattern(URL_RE, "an http(s) URL without spaces or quotes"))
    _dir = field_validator("wheelhouse")(_pattern(PATH_RE, PATH_CHARS))


class ClusterSpec(Section):
    name: str = "local"
    nodes: Nodes = Nodes()
    hardware: Hardware = Hardware()
    topology: Topology = Topology()
    storage: Storage = Storage()
    scheduler: Scheduler = Scheduler()
    monitoring: Monitoring = Monitoring()
    validate_: Thresholds = Field(Thresholds(), alias="validate")
    reliability: Reliability = Reliability()
    cost: Cost = Cost()
    provision: Provision = Provision()
    cloud: Cloud | None = None         # a cloud kind of cluster: rented through SkyPilot

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    _name = field_validator("name")(_pattern(NAME_RE, NAME_CHARS))

    @model_validator(mode="after")
    def _cross(self):
        for area, claim in self.storage.kubernetes.items():
            if area == "checkpoints" and claim.read_only:
                raise ValueError("storage.kubernetes.checkpoints.read_only: checkpoints must be writable")
        default = self.scheduler.default
        check_storage_root(self.storage.root, None if default == "local" else f"on a {default} cluster")
        return self

    # -- what the commands ask --
    @property
    def node_count(self) -> int:
        return self.nodes.n

    @property
    def hosts(self) -> list[str]:
        """The node names; a cluster given by count only has none (monitor config then needs them)."""
        return self.nodes.names

    @property
    def gpus_per_node(self) -> int:
        return self.hardware.gpus_per_node or 0

    @property
    def total_gpus(self) -> int:
        return self.node_count * self.gpus_per_node

    @property
    def thresholds(self) -> Thresholds:
        return self.validate_

    def node_gpus(self, host: str) -> int:
        """GPUs on one node: its override, else hardware.gpus_per_node."""
        for key, o in self.nodes.overrides.items():
            if o.gpus_per_node is not None and host in expand_hostlist(key):
                return o.gpus_per_node
        return self.gpus_per_node


# Keys of the formats this spec replaces (plan `cluster:` section, validate's spec, monitor's node list): a file
# that still uses one is refused in one line that names the new key.
OLD_KEYS = {
    "gpu": "hardware.gpu", "gpus_per_node": "hardware.gpus_per_node", "fabric": "hardware.fabric",
    "nics_per_node": "hardware.nics_per_node", "nic_GBps": "hardware.nic_GBps",
    "intra_node": "hardware.intra_node", "intra_node_busbw_GBps": "hardware.intra_node_busbw_GBps",
    "node_power_kw": "hardware.node_power_kw", "gpu_reserved_gib": "hardware.gpu_reserved_gib",
    "allocator_slack": "hardware.allocator_slack", "switch_radix": "topology.switch_radix",
    "rack_kw": "topology.rack_kw", "air_cooling_max_kw": "topology.air_cooling_max_kw",
    "intra_latency_us": "topology.intra_latency_us", "inter_latency_us": "topology.inter_latency_us",
    "storage_write_GBps": "storage.areas.checkpoints.write_GBps",
    "storage_read_GBps": "storage.areas.datasets.read_GBps",
    "node_mtbf_hours": "reliability.node_mtbf_hours", "restart_minutes": "reliability.restart_minutes",
    "hosts": "nodes.hosts", "cluster": "the top level (a cluster file is the cluster: no `cluster:` section)",
}
OLD_VALIDATE_KEYS = {"gpu": "hardware.gpu", "gpus_per_node": "hardware.gpus_per_node",
                     "storage": "storage.areas.<area>.write_GBps / read_GBps / files_per_s"}


def old_format_key(data: dict[str, Any]) -> tuple[str, str] | None:
    """(old key, new key) for the first key of a superseded format in `data`, else None."""
    for key, new in OLD_KEYS.items():
        if key in data:
            return key, new
    nodes = data.get("nodes")
    if isinstance(nodes, bool):
        return None
    if isinstance(nodes, int):
        return "nodes", "nodes.count"
    if isinstance(nodes, (str, list)):
        return "nodes", "nodes.hosts"
    validate = data.get("validate")
    if isinstance(validate, dict):
        for key, new in OLD_VALIDATE_KEYS.items():
            if key in validate:
                return f"validate.{key}", new
    return None
