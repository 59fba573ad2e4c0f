"""`llmcluster provision`: the cluster spec -> an Ansible project (inventory, site.yml, roles, group_vars).

The roles and site.yml ship inside the package (llmcluster/assets/ansible); what differs per cluster is data:
the inventory (head node, nodes with their GPU/HCA counts, the storage clients) and group_vars (the pinned
versions from the one versions file, the storage mounts and layout, Slurm's nodes, GRES and switches).
An output directory is only ever written when it is empty or was written by provision before (its marker
file), so a typo in --out never overwrites someone's files.

The spec is data, never template or code (docs/security.md): its strings are validated on load (config/cluster.py),
every string var is written `!unsafe` so Ansible never templates it (a `{{ lookup('pipe', ...) }}` would run
on the machine that applies the playbook), and the roles quote what reaches a shell or a systemd unit.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmcluster import __version__
from llmcluster.config import strict_yaml
from llmcluster.config.cluster import CPU_ONLY, ClusterSpec, check_storage_root
from llmcluster.errors import UserError
from llmcluster.paths import asset_dir
from llmcluster.provision import slurm, wheel as ml_wheel
from llmcluster.render import comment_text, line_text, shell_join
from llmcluster.storage.layout import AREAS, DATASET_KINDS

MARKER = ".llmcluster-provision"
VERSIONS_FILE = Path(__file__).with_name("versions.yaml")
CLUSTER_FILE_ON_HOSTS = "/etc/llmcluster/cluster.yaml"
VENV_ON_HOSTS = "/opt/llmcluster/venv"
MOUNT_OPTIONS = {"lustre": "defaults,_netdev,flock", "weka": "defaults,_netdev",
                 "nfs": "defaults,_netdev,hard,nconnect=8,rsize=1048576,wsize=1048576"}
SOURCE_EXAMPLES = {"lustre": "10.0.0.10@o2ib:/lustre", "weka": "weka01/default", "nfs": "nfs01:/export/storage"}


@dataclass(frozen=True)
class Rendered:
    out: Path
    hosts: list[str]
    head: str
    scheduler: str
    warnings: list[str]
    wheel: str


def versions() -> dict:
    return strict_yaml.load(VERSIONS_FILE.read_text())


def host_names(spec: ClusterSpec) -> tuple[list[str], list[str]]:
    """(names, warnings): the spec's hosts, or numbered placeholders for a cluster given by count."""
    if spec.hosts:
        return spec.hosts, []
    width = max(2, len(str(spec.node_count)))
    names = [f"{spec.name}-{i:0{width}d}" for i in range(1, spec.node_count + 1)]
    return names, [f"nodes.hosts is not set: the inventory names the {spec.node_count} nodes {names[0]}.."
                   f"{names[-1]}; list the real names in nodes.hosts"]


def head_node(spec: ClusterSpec, hosts: list[str]) -> str:
    """scheduler.slurm.head_node, else the first node (a one-node cluster is its own head)."""
    return spec.scheduler.slurm.head_node or hosts[0]


def host_vars(spec: ClusterSpec, host: str, is_node: bool) -> dict:
    """What the gpu and fabric levels decide on. The head node (not described by the spec) has neither."""
    h = spec.hardware
    gpus = spec.node_gpus(host) if is_node else 0
    rdma = is_node and h.fabric in slurm.RDMA_FABRICS
    gpu = h.spec if h.gpu != CPU_ONLY else None
    return {
        "node_gpus": gpus,
        "node_hcas": h.nics if rdma else 0,
        "node_fabric_link": h.fabric.split("-")[0] if rdma else "none",
        # HGX boards with 8 NVLink GPUs route NVLink through NVSwitch chips, which need Fabric Manager;
        # 4-GPU HGX (A100) boards link the GPUs directly.
        "node_nvswitch": bool(gpu and gpu.nvlink_gbps and gpus == 8 and h.intra_node != "pcie"),
    }


def inventory(spec: ClusterSpec, hosts: list[str], head: str) -> dict:
    head_hosts = {head: None if head in hosts else host_vars(spec, head, is_node=False)}
    return {"all": {"children": {
        "head": {"hosts": head_hosts},
        "nodes": {"hosts": {h: host_vars(spec, h, is_node=True) for h in hosts}},
        "storage": {"children": {"head": None, "nodes": None}},
    }}}


def storage_vars(spec: ClusterSpec) -> tuple[dict, list[str]]:
    """The storage level's data: the layout (from storage/layout.py) and the mounts each backend needs."""
    st, root = spec.storage, spec.storage.root.rstrip("/") or "/"
    warnings: list[str] = []
    mounts = []
    if st.backend not in ("local", "gpfs"):
        mounts.append({"area": "", "path": root, "backend": st.backend, "options": MOUNT_OPTIONS[st.backend]})
    for area in AREAS:
        b = st.area(area).backend
        if b != st.backend and b not in ("local", "gpfs"):
            mounts.append({"area": area, "path": f"{root}/{area}", "backend": b, "options": MOUNT_OPTIONS[b]})
    if "gpfs" in {st.backend, *(st.area(a).backend for a in AREAS)}:
        warnings.append("storage backend gpfs: IBM Storage Scale installs its own client (mmmount); "
                        "the storage level only lays out the areas")
    # datasets inside a shared mount: a read-only bind mount on the workers (the head node writes them)
    if any(m["area"] == "" for m in mounts) and not any(m["area"] == "datasets" for m in mounts):
        mounts.append({"area": "datasets", "path": f"{root}/datasets", "backend": "bind", "options": "bind,ro"})
    return {
        "storage_root": root,
        "storage_areas": list(AREAS) + [f"datasets/{k}" for k in DATASET_KINDS],
        "storage_mounts": mounts,
        # where each mount comes from is site data the spec does not hold: fill in before applying
        "storage_sources": {m["path"]: (f"{root}/datasets" if m["backend"] == "bind" else None) for m in mounts},
        "storage_source_examples": {m["path"]: SOURCE_EXAMPLES[m["backend"]] for m in mounts
                                    if m["backend"] in SOURCE_EXAMPLES},
    }, warnings


def ml_vars(spec: ClusterSpec, wheel: Path) -> dict:
    """The ml level's sources: our wheel (shipped in files/), its dependencies, torch's index or a wheelhouse."""
    p = spec.provision
    version, requirements = ml_wheel.read_wheel(wheel)
    return {"provision_wheel": wheel.name, "provision_llmcluster_version": version,
            "provision_requirements": requirements,
            "provision_torch_index": p.torch_index or "", "provision_wheelhouse": p.wheelhouse or ""}


def cluster_vars(spec: ClusterSpec, hosts: list[str], head: str, scheduler: str) -> tuple[dict, list[str]]:
    nodes = slurm.slurm_nodes(spec, hosts)
    switches, tree = slurm.topology_switches(spec, hosts)
    storage, warnings = storage_vars(spec)
    gpus = spec.gpus_per_node > 0
    partition = spec.scheduler.slurm.partition or ("gpu" if gpus else "cpu")
    slurm.check_words(spec.name, partition, nodes, switches)
    return {
        "provision_cluster_name": spec.name,
        "provision_head": head,
        "provision_scheduler": scheduler,
        "provision_slurm_image": spec.scheduler.slurm.image or "",
        "provision_cluster_file": CLUSTER_FILE_ON_HOSTS,
        "provision_venv": VENV_ON_HOSTS,
        "provision_exporter_port": spec.monitoring.exporter_port,
        **storage,
        "scheduler_slurm_partition": partition,
        "scheduler_slurm_nodes": nodes,
        "scheduler_slurm_memory_share": 1 - slurm.MEMORY_RESERVE,   # of a node's own memory, when the spec has none
        "scheduler_slurm_gres": slurm.slurm_gres(nodes),
        "scheduler_slurm_switches": switches,
        "scheduler_slurm_fat_tree": tree,
    }, warnings


def prometheus_yml(spec: ClusterSpec, hosts: list[str]) -> dict:
    from llmcluster.monitor.scrape_config import RULE_FILES, prometheus_config

    m = spec.monitoring
    per_node = m.train_ports_per_node or max(1, spec.gpus_per_node)
    cfg = prometheus_config(hosts, m.exporter_port, m.train_port, per_node, m.scrape_interval, rules_dir=None)
    return {**cfg, "rule_files": [f"/etc/prometheus/llmcluster/{f}" for f in RULE_FILES]}


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise UserError(f"--out {out} is not empty and was not written by llmcluster provision: "
                        "refusing to overwrite it (give an empty or new directory)")


class _Unsafe(str):
    """A string Ansible must take as it is: dumped with the `!unsafe` tag."""


class _AnsibleDumper(yaml.SafeDumper):
    """A safe dumper (every string a plain, quoted or block scalar as YAML requires) that writes `!unsafe` for
    _Unsafe strings, and never an anchor: a value repeated is written twice."""

    def ignore_aliases(self, data):
        return True


_AnsibleDumper.add_representer(_Unsafe, lambda d, s: d.represent_scalar("!unsafe", str(s)))


def _unsafe(data):
    """Every string value tagged (mapping keys stay plain: Ansible never templates a key, and the inventory's
    group and host keys are its structure). Not the empty string: Ansible reads `!unsafe ''` as null."""
    if isinstance(data, str):
        return _Unsafe(data) if data else data
    if isinstance(data, dict):
        return {k: _unsafe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_unsafe(v) for v in data]
    return data


def _dump(path: Path, data, header: str, unsafe: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(_unsafe(data) if unsafe else data, Dumper=_AnsibleDumper, sort_keys=False,
                     default_flow_style=False, width=120)
    path.write_text(f"---\n# {comment_text(header)}\n{text}")


def provision(spec: ClusterSpec, cluster_text: str, out: Path, scheduler: str | None = None,
              wheel: str | None = None) -> Rendered:
    """Write the Ansible project for `spec` into `out` (see the module docstring)."""
    scheduler = scheduler or spec.scheduler.default
    if spec.cloud is not None:   # rented nodes: SkyPilot starts and sets them up from its own image, per run
        raise UserError(f"cluster {spec.name!r} is a cloud ({spec.cloud.provider}) whose nodes SkyPilot rents and "
                        "sets up per run: nothing to provision (llmcluster launch --scheduler skypilot)")
    try:       # the nodes mount it, whatever scheduler.default says (`--scheduler slurm` on a local spec)
        check_storage_root(spec.storage.root, "on the nodes provision sets up")
    except ValueError as e:
        raise UserError(str(e)) from None
    line_text(str(out), "--out")          # the apply line printed at the end names it: refused before writing
    check_out_dir(out)
    whl = ml_wheel.resolve(wheel or spec.provision.wheel)
    hosts, warnings = host_names(spec)
    head = head_node(spec, hosts)
    cvars, more = cluster_vars(spec, hosts, head, scheduler)
    cvars.update(ml_vars(spec, whl))
    warnings += more
    out.mkdir(parents=True, exist_ok=True)
    src = asset_dir("ansible")
    shutil.rmtree(out / "roles", ignore_errors=True)   # ours (marker checked): stale role files must not linger
    shutil.copytree(src / "roles", out / "roles")
    shutil.copy2(src / "site.yml", out / "site.yml")
    shutil.copy2(src / "ansible.cfg", out / "ansible.cfg")
    mon = asset_dir("monitoring")
    files = out / "roles" / "monitoring" / "files"
    files.mkdir(parents=True, exist_ok=True)
    for f in ("alerts.yml", "recording.yml"):
        shutil.copy2(mon / f, files / f)
    shutil.copytree(mon / "grafana", files / "grafana", dirs_exist_ok=True)
    (out / "files").mkdir(exist_ok=True)
    (out / "files" / "cluster.yaml").write_text(cluster_text)
    for old in (out / "files").glob("llmcluster-*.whl"):     # ours (marker checked): one wheel, the current one
        old.unlink()
    shutil.copy2(whl, out / "files" / whl.name)
    _dump(out / "files" / "prometheus.yml", prometheus_yml(spec, hosts), "the head node's Prometheus")
    _dump(out / "inventory.yml", inventory(spec, hosts, head), f"cluster {spec.name}: rendered by llmcluster provision",
          unsafe=True)
    _dump(out / "group_vars" / "all" / "versions.yml", {"provision_versions": versions()},
          "pinned versions (llmcluster/provision/versions.yaml)")
    _dump(out / "group_vars" / "all" / "cluster.yml", cvars,
          f"cluster {spec.name}: facts the roles read, from the cluster spec (!unsafe: data, never templated)",
          unsafe=True)
    (out / MARKER).write_text(f"llmcluster {__version__}\n")
    return Rendered(out, hosts, head, scheduler, warnings, whl.name)


def apply_command(out: Path | str) -> str:
    """The copyable ansible-playbook line for a rendered project, quoted for the shell."""
    return shell_join(["ansible-playbook", "-i", f"{out}/inventory.yml", f"{out}/site.yml"])


def run(cluster: str | None, out: Path, overrides: list[str] | None = None, scheduler: str | None = None,
        wheel: str | None = None) -> int:
    from llmcluster.config.cluster_load import load_cluster

    resolved = load_cluster(cluster, overrides)
    text = Path(resolved.source).read_text() if not resolved.is_default else ""
    if resolved.overrides or resolved.is_default:
        text = yaml.safe_dump(resolved.spec.model_dump(by_alias=True, exclude_defaults=True), sort_keys=False)
    r = provision(resolved.spec, text, out, scheduler, wheel)
    for w in r.warnings:
        print(f"llmcluster provision: warning: {w}", file=sys.stderr)
    print(f"provisioned {resolved.spec.name}: {len(r.hosts)} node(s), head {r.head}, scheduler {r.scheduler} "
          f"-> {out}/ (inventory.yml, site.yml, roles/, group_vars/, files/{r.wheel})")
    print(f"  apply:  {apply_command(out)} [--tags os,gpu,fabric,storage,scheduler,container,ml,monitoring]")
    return 0
