"""The cluster spec: the shipped examples, resolution order, `--set`, old formats refused in one line, hostlists."""

from pathlib import Path

import pytest

from llmcluster.config.cluster import ClusterSpec
from llmcluster.config.cluster_load import DEFAULT_SOURCE, load_cluster
from llmcluster.config.hostlist import compress_hostlist, expand_hostlist
from llmcluster.errors import UserError
from llmcluster.paths import shipped_names

REPO = Path(__file__).resolve().parent.parent

MINIMAL = """\
name: seed
nodes: {hosts: "gpu[01-08]"}
hardware: {gpu: A100-80GB, gpus_per_node: 4, cpus_per_node: 64, memory_gb: 512, fabric: ib-ndr, nics_per_node: 4}
storage:
  root: /storage
  kubernetes: {datasets: {claim: datasets-pvc, read_only: true}, checkpoints: {claim: checkpoints-pvc}}
scheduler:
  slurm: {partition: gpu}
  kubernetes: {namespace: llm, image: registry.example.com/llmcluster:0.1}
"""


def test_the_issue_minimal_shape_loads_as_written(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(MINIMAL)
    c = load_cluster(str(f), environ={}).spec
    assert c.name == "seed" and c.hosts == [f"gpu{i:02d}" for i in range(1, 9)]
    assert c.node_count == 8 and c.gpus_per_node == 4 and c.total_gpus == 32
    assert c.hardware.spec.memory_gb == 80 and c.hardware.nics == 4
    assert c.storage.kubernetes["datasets"].read_only and not c.storage.kubernetes["checkpoints"].read_only
    assert c.scheduler.slurm.partition == "gpu" and c.scheduler.kubernetes.namespace == "llm"


def test_shipped_examples_and_the_checkout_link():
    assert set(shipped_names("clusters")) >= {"seed-a100", "h200-8x", "rtx4090-box"}
    assert (REPO / "clusters" / "seed-a100.yaml").is_file()     # top-level link into llmcluster/assets
    seed = load_cluster("seed-a100", environ={}).spec
    assert seed.hardware.gpu == "A100-80GB" and seed.hardware.fabric == "ib-ndr"
    assert seed.storage.root == "/storage" and seed.storage.backend == "lustre"
    box = load_cluster("rtx4090-box", environ={}).spec
    assert box.total_gpus == 2 and box.hardware.spec.nvlink_gbps is None
    h200 = load_cluster("h200-8x", environ={}).spec
    assert h200.total_gpus == 32 and h200.scheduler.kubernetes.kind == "volcano"   # gang_scheduler: volcano


def test_resolution_order_flag_env_cwd_default(tmp_path):
    (tmp_path / "cluster.yaml").write_text("name: here\n")
    other = tmp_path / "other.yaml"
    other.write_text("name: env\n")
    assert load_cluster(None, environ={}, cwd=tmp_path).spec.name == "here"
    assert load_cluster(None, environ={"LLMCLUSTER_CLUSTER": str(other)}, cwd=tmp_path).spec.name == "env"
    assert load_cluster("seed-a100", environ={"LLMCLUSTER_CLUSTER": str(other)}, cwd=tmp_path).spec.name == "seed"
    d = load_cluster(None, environ={}, cwd=tmp_path / "nowhere")
    assert d.source == DEFAULT_SOURCE and d.spec.node_count == 1 and d.spec.gpus_per_node == 0


def test_cpu_only_and_gpu_consistency():
    assert ClusterSpec.model_validate({"hardware": {"gpu": "none", "gpus_per_node": 0}}).total_gpus == 0
    with pytest.raises(ValueError, match="gpus_per_node is required"):
        ClusterSpec.model_validate({"hardware": {"gpu": "H100"}})
    with pytest.raises(ValueError, match="gpu is none"):
        ClusterSpec.model_validate({"hardware": {"gpus_per_node": 8}})


def test_set_overrides_and_count_replaces_hosts():
    c = load_cluster("seed-a100", ["nodes.count=32", "hardware.gpus_per_node=8", "validate.tolerance=0.2"],
                     environ={}).spec
    assert c.node_count == 32 and c.hosts == [] and c.total_gpus == 256 and c.thresholds.tolerance == 0.2


@pytest.mark.parametrize("text,needles", [
    ("gpu: H100\nnodes: 4\n", ["'gpu'", "hardware.gpu"]),
    ("nodes: 4\n", ["'nodes'", "nodes.count"]),
    ("hosts: gpu[1-2]\n", ["'hosts'", "nodes.hosts"]),
    ("cluster:\n  gpu: H100\n", ["'cluster'"]),
    ("validate:\n  gpus_per_node: 8\n", ["validate.gpus_per_node", "hardware.gpus_per_node"]),
    ("storage_write_GBps: 5\n", ["storage.areas.checkpoints.write_GBps"]),
    ("hardware: {gpu: A100-80GB, gpus_per_nod: 4}\n", ["hardware.gpus_per_nod", "did you mean", "gpus_per_node"]),
    ("hardware: {gpu: V100, gpus_per_node: 4}\n", ["unknown GPU 'V100'"]),
    ("nodes: {hosts: 'gpu[01-02]', count: 3}\n", ["nodes.count (3)", "2 hosts"]),
    ("nodes: {hosts: 'gpu[01-02]', overrides: {gpu07: {gpus_per_node: 2}}}\n", ["gpu07 is not in nodes.hosts"]),
    ("scheduler: {slurm: {partition: 'gpu;rm -rf'}}\n", ["partition", "not allowed"]),
    ("storage: {kubernetes: {checkpoints: {claim: c, read_only: true}}}\n", ["checkpoints must be writable"]),
])
def test_bad_and_old_files_are_one_line(tmp_path, text, needles):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(UserError) as e:
        load_cluster(str(f), environ={})
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_bad_set_key_names_the_closest():
    with pytest.raises(UserError, match="did you mean 'hardware.gpus_per_node'"):
        load_cluster("seed-a100", ["hardware.gpu_per_node=2"], environ={})


def test_missing_cluster_names_the_shipped_ones():
    with pytest.raises(UserError, match="seed-a100"):
        load_cluster("nope", environ={})


def test_storage_areas_match_the_layout():
    from llmcluster.config.cluster import AREAS
    from llmcluster.storage.layout import AREAS as LAYOUT

    assert AREAS == LAYOUT


def test_per_node_override():
    c = ClusterSpec.model_validate({"nodes": {"hosts": "gpu[01-04]", "overrides": {"gpu[03-04]": {"gpus_per_node": 2}}},
                                    "hardware": {"gpu": "H100", "gpus_per_node": 8}})
    assert [c.node_gpus(h) for h in c.hosts] == [8, 8, 2, 2]


def test_hostlist_round_trip():
    names = expand_hostlist("gpu[01-03,07],login")
    assert names == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert compress_hostlist(names) == "gpu[01-03,07],login"
    assert expand_hostlist(compress_hostlist(["n1", "n2", "n10"])) == ["n1", "n2", "n10"]
    with pytest.raises(UserError):
        expand_hostlist("gpu[05-01]")


# ---- cluster init / show ------------------------------------------------------------------------------------
SCONTROL = (  # `scontrol show nodes -o` as Slurm 22.05 prints it (two GPU nodes)
    "NodeName=gpu01 Arch=x86_64 CoresPerSocket=32 CPUAlloc=0 CPUTot=64 Gres=gpu:a100:4(S:0-1) NodeAddr=gpu01 "
    "RealMemory=515000 Partitions=gpu,debug State=IDLE\n"
    "NodeName=gpu02 Arch=x86_64 CoresPerSocket=32 CPUAlloc=0 CPUTot=64 Gres=gpu:a100:4(S:0-1) NodeAddr=gpu02 "
    "RealMemory=515000 Partitions=gpu,debug State=IDLE\n")


def fake_sysfs(root: Path, n: int, rate: str, layer: str) -> Path:
    for i in range(n):
        port = root / f"mlx5_{i}" / "ports" / "1"
        port.mkdir(parents=True)
        (port / "rate").write_text(rate + "\n")
        (port / "link_layer").write_text(layer + "\n")
    return root


def test_parse_scontrol_and_gres():
    from llmcluster.config.cluster_init import gres_gpus, parse_scontrol_nodes

    nodes = parse_scontrol_nodes(SCONTROL)
    assert [n["NodeName"] for n in nodes] == ["gpu01", "gpu02"] and nodes[0]["CPUTot"] == "64"
    assert gres_gpus("gpu:a100:4(S:0-1),shard:8") == 4 and gres_gpus("(null)") == 0 and gres_gpus("gpu:2") == 2


def test_cluster_init_fills_from_scontrol_nvidia_smi_and_sysfs(tmp_path):
    """nvidia-smi and an HCA cannot exist here: their answers are given (nvidia-smi's text, a sysfs tree)."""
    from llmcluster.config.cluster_init import detect, init_cluster

    answers = {"scontrol": SCONTROL, "nvidia-smi": "NVIDIA A100-SXM4-80GB\n" * 4}
    facts = detect(run=lambda argv: answers.get(argv[0]),
                   sysfs=fake_sysfs(tmp_path / "ib", 4, "400 Gb/sec (4X NDR)", "InfiniBand"),
                   storage=tmp_path / "nostorage")
    out = tmp_path / "cluster.yaml"
    text = init_cluster(out, name="seed", facts=facts)
    assert "# detected: scontrol (2 nodes), nvidia-smi (4 x NVIDIA A100-SXM4-80GB)" in text
    c = load_cluster(str(out), environ={}).spec
    assert c.hosts == ["gpu01", "gpu02"] and c.hardware.gpu == "A100-80GB" and c.gpus_per_node == 4
    assert c.hardware.cpus_per_node == 64 and c.hardware.memory_gb == 515
    assert c.hardware.fabric == "ib-ndr" and c.hardware.nics_per_node == 4
    assert c.scheduler.default == "slurm" and c.scheduler.slurm.partition == "gpu"
    with pytest.raises(UserError, match="exists: not overwriting"):
        init_cluster(out, facts=facts)
    assert out.read_text() == text                                  # untouched
    roce = detect(run=lambda argv: None, sysfs=fake_sysfs(tmp_path / "r", 2, "200 Gb/sec (4X HDR)", "Ethernet"),
                  storage=tmp_path / "nostorage")
    c = ClusterSpec.model_validate(__import__("yaml").safe_load(init_cluster(tmp_path / "r.yaml", facts=roce)))
    assert c.hardware.fabric == "roce-200" and c.gpus_per_node == 0 and c.node_count == 1


def test_cluster_init_on_a_bare_host_and_show_sources(tmp_path):
    import json
    import sys

    from conftest import cli_env, run_cli

    env = {**cli_env(), "PATH": str(Path(sys.executable).parent)}    # no scontrol, no nvidia-smi on PATH
    env.pop("LLMCLUSTER_CLUSTER", None)
    p = run_cli("cluster", "init", cwd=tmp_path, env=env, check=True)
    assert "wrote cluster.yaml" in p.stdout
    assert load_cluster(None, environ={}, cwd=tmp_path).spec.gpus_per_node == 0
    shown = json.loads(run_cli("cluster", "show", "--cluster", "seed-a100", "--set", "hardware.gpus_per_node=8",
                               "--json", check=True).stdout)
    v = shown["values"]
    assert v["hardware.gpus_per_node"] == {"value": 8, "source": "--set"}
    assert v["scheduler.slurm.partition"]["value"] == "gpu" and v["scheduler.slurm.partition"]["source"].endswith(
        "seed-a100.yaml")
    assert v["monitoring.exporter_port"] == {"value": 9400, "source": "default"}
    text = run_cli("cluster", "show", cwd=tmp_path, check=True).stdout     # ./cluster.yaml, found by the cwd rule
    assert "found by ./cluster.yaml" in text


def test_docs_cluster_md_lists_every_key():
    """docs/cluster.md documents every key of the schema (a key added without its row fails here)."""
    from pydantic import BaseModel

    doc = (REPO / "docs" / "cluster.md").read_text()
    missing = []

    def walk(cls, prefix):
        for name, f in cls.model_fields.items():
            key = prefix + (f.alias or name)
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
                walk(f.annotation, key + ".")
            elif f"`{key}" not in doc and f"`{key.rsplit('.', 1)[-1]}`" not in doc \
                    and f"{key.rsplit('.', 1)[-1]}," not in doc:
                missing.append(key)

    walk(ClusterSpec, "")
    assert not missing, missing


def test_errors_one_line_and_exit_codes(capsys):
    from conftest import cli_inprocess
    from llmcluster import errors
    from llmcluster.errors import RunFailure

    assert (errors.EXIT_OK, errors.EXIT_FAILURE, errors.EXIT_USAGE, errors.EXIT_PREEMPTED) == (0, 1, 2, 75)
    assert str(RunFailure("a\n  b")) == "a b" and RunFailure("x").exit_code == 1
    assert str(UserError("c\nd")) == "c d" and UserError("x").exit_code == 2
    p = cli_inprocess(capsys, "cluster", "show", "--cluster", "nope")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "cluster file not found" in p.stderr


def test_random_cluster_files_load_or_fail_in_one_line(tmp_path):
    """Whatever a cluster file holds, the loader answers with a spec or a one-line UserError (nothing else)."""
    import yaml
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    keys = st.sampled_from(["name", "nodes", "hosts", "count", "overrides", "hardware", "gpu", "gpus_per_node",
                            "fabric", "storage", "root", "kubernetes", "datasets", "claim", "read_only", "areas",
                            "scheduler", "slurm", "partition", "validate", "tolerance", "cost", "x"])
    leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.floats(allow_nan=False, width=32),
                       st.sampled_from(["gpu[01-03]", "a[", "H100", "none", "ib-ndr", "/storage", "", "x;y"]))
    docs = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(keys, inner, max_size=4)), max_leaves=12)

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(doc=st.dictionaries(keys, docs, max_size=5))
    def check(doc):
        f = tmp_path / "c.yaml"
        f.write_text(yaml.safe_dump(doc))
        try:
            load_cluster(str(f), environ={})
        except UserError as e:
            assert "\n" not in str(e)

    check()
