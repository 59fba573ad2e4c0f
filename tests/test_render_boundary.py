"""The hostile-string property test across every renderer (issue 32): one list, RENDERERS, of every field of
every artefact we render; each is fed the same hostile strings (a fixed list that always runs, plus hypothesis).

For each renderer x string: either the build is refused with one UserError line, or parsing the artefact back
as its consumer would yields exactly the intended value and nothing else changed:
  * bash scripts: `bash -n`, then bash itself says the words of the lines that carry the value (`set -- LINE`);
    every other line is the line a benign value renders; `#SBATCH` lines all before the first command, each
    read as sbatch reads it (a '%' in a filename pattern as Slurm expands it);
  * YAML: yaml.safe_load_all; the value round-trips exactly (container command/args/env after the kubelet's
    $(VAR) expansion), and the documents have the same keys as with a benign value (no extra key or document);
  * the Ansible vars: the value round-trips and carries the `!unsafe` tag (test_spec_injection.py runs the
    real playbook over such a value; its reader, ansible_helpers.read_rendered, is the one used here).

To cover a new renderer, add ONE entry to RENDERERS: `"artefact: field": build`, where `build(value)` renders
the artefact with `value` in that field the way the command does (through its own validation: a refusal is a
UserError) and returns `(artefact_text, parse_back)`; `parse_back()` reads the field back out of artefact_text
as its consumer would and asserts it holds exactly the intended value and that nothing else changed. Three
makers build such entries from a render function `render(value) -> text` (they also render a benign value once,
the reference every other line / key must match):

    # a bash script (serve start's launch.sh / sbatch, the downstream eval sbatch): bash's words of the lines
    # that carry the value (`differs` picks them in the benign render), asserted by `check(words, value)`
    "serve local: served-model name": script_entry(lambda v: <render the script with name v>,
                                                   check=lambda words, v: <assert on bash's words>,
                                                   differs=lambda line: <the line carries the name>),
    # an #SBATCH value, read as sbatch reads it (all #SBATCH lines before the first command)
    "eval sbatch: job name": sbatch_entry(lambda v: <render with v>, "job-name", want=lambda v: v),
    # YAML (serve's Deployment): the documents loaded, same keys as the benign render; container
    # command/args/env compared after `kubelet()` expansion
    "serve k8s: model name": yaml_entry(lambda v: <render with v>, lambda docs, v: <assert on docs>),

`benign=` names a value the field's grammar takes when the word "benign" is not one (a time limit, a duration).
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import yaml
from ansible_helpers import read_rendered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmcluster.errors import UserError

# -- the hostile strings ----------------------------------------------------------------------------------------
HOSTILE = [
    "a\nb", "a\rb", "a\r\nb", "a\u2028b", "a\u2029b", "a\x85b", "a\x0bb", "a\x00b",    # line breaks, NUL
    "$(touch pwned)", "`touch pwned`", "$(HF_TOKEN)", "$$(HOME)", "${PATH}$HOME",      # shell / kubelet expansion
    "{{ lookup('pipe', 'touch pwned') }}", "{% if true %}x{% endif %}",                 # Jinja (Ansible)
    "100%j%u%%x%", "--help", "-rf",                                                     # Slurm patterns, options
    "it's", 'say "hi"', "'\"'\"", "\\", "a b;touch pwned", "x && touch pwned | y &",   # quotes, metacharacters
    "key: value", "- item", "&a *a !!python/object/apply:os.system ['id']", "# c", "...", "---",   # YAML
    " lead", "trail ", "\t", "", "ünï ٥ 🙂", "gpu01,gpu02", "h:1", "[::1]",
    "x" * 100_000,
]
PIECES = ["\n", "\r", "\u2028", "\x85", "$(", ")", "`", "{{", "}}", "{%", "%", "--", "'", '"', "\\", " ", ";",
          ":", "#", ",", "=", "@", "[", "]", "/", "-", "a", "0", "٥"]
STRINGS = st.one_of(st.text(max_size=40),
                    st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=12).map("".join))
BENIGN = "benign"
SHA256 = re.compile(r"\b[0-9a-f]{64}\b")
WORK = Path(tempfile.mkdtemp(prefix="llmc-boundary-"))   # cwd of every bash run: `touch pwned` would land here
# every process that imports this module makes one (an xdist worker collects it without running it): removed at exit
atexit.register(shutil.rmtree, WORK, True)


# -- reading a bash script back -----------------------------------------------------------------------------------

def script_words(lines: list[str]) -> list[list[str]]:
    """The words bash makes of each line (`set -- LINE`, one bash for all): quoting as bash reads it. A line's
    trailing `&` is dropped (the command runs in the background; its words are the same)."""
    if not lines:
        return []
    prog = "\n".join(f"set -- {ln.removesuffix(' &')}\nprintf '%s\\0' \"$#\" \"$@\"" for ln in lines)
    p = subprocess.run(["bash", "-s"], input=prog.encode("utf-8", "surrogateescape"), cwd=WORK,
                       capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    out, words = p.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1], []
    while out:
        n = int(out.pop(0))
        words.append(out[:n])
        del out[:n]
    return words


def bash_syntax(text: str) -> None:
    p = subprocess.run(["bash", "-n"], input=text.encode("utf-8", "surrogateescape"), capture_output=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]


def check_script(text: str, benign: str, differs: Callable[[str], bool], reader=None) -> list[list[str]]:
    """`text` is valid bash with the benign render's lines, but for those `differs` picks in the benign render
    (the lines that carry the value); returns the words of those lines (bash's, or `reader`'s)."""
    bash_syntax(text)
    lines, base = text.split("\n"), benign.split("\n")
    assert len(lines) == len(base), "the value changed the number of lines"
    picked = [i for i, ln in enumerate(base) if differs(ln)]
    # the sha256 of the launch's config (a Slurm job checks it before training) changes with any value, by design
    changed = [i for i, ln in enumerate(lines) if SHA256.sub("", ln) != SHA256.sub("", base[i]) and i not in picked]
    assert not changed, [lines[i][:200] for i in changed]
    words = (reader or script_words)([lines[i] for i in picked])
    assert not (WORK / "pwned").exists(), "a payload ran"
    return words


def sbatch_directives(script: str) -> dict[str, str]:
    """The #SBATCH options as sbatch reads them: only from the comment block before the first command (sbatch
    stops there); every #SBATCH line must be in it."""
    opts, lines = {}, script.split("\n")
    first_cmd = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert not [ln for ln in lines[first_cmd:] if ln.startswith("#SBATCH")], "an #SBATCH line after a command"
    for ln in lines[:first_cmd]:
        if ln.startswith("#SBATCH --"):
            key, _, value = ln[len("#SBATCH --"):].partition("=")
            assert key not in opts, f"#SBATCH --{key} twice"
            opts[key] = value
    return opts


def slurm_filename(pattern: str, job_id: str = "7") -> str:
    """What Slurm makes of an --output pattern: %% a '%', %j the job id, any other %x a replacement."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "%" and i + 1 < len(pattern):
            c = pattern[i + 1]
            out.append("%" if c == "%" else job_id if c == "j" else f"<%{c}>")
            i += 2
        else:
            out.append(pattern[i])
            i += 1
    return "".join(out)


# -- reading YAML back ----------------------------------------------------------------------------------------------

def key_paths(data, prefix=()) -> set:
    """Every key path of a loaded document (list items by index): two renders with the same paths differ in
    values only."""
    if isinstance(data, dict):
        return {prefix + (k,) for k in data} | {p for k, v in data.items() for p in key_paths(v, prefix + (k,))}
    if isinstance(data, list):
        return {p for i, v in enumerate(data) for p in key_paths(v, prefix + (i,))}
    return set()


SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml's: the same safe constructors, faster


def load_all(text: str) -> list:
    return list(yaml.load_all(text, Loader=SafeLoader))


def check_yaml(text: str, benign: str) -> list:
    """The documents of `text` (safe_load_all), with the same number of documents and the same keys as the
    benign render."""
    docs, base = load_all(text), load_all(benign)
    assert len(docs) == len(base), "the value added a YAML document"
    assert [key_paths(d) for d in docs] == [key_paths(d) for d in base], "the value changed the keys"
    return docs


def kubelet(value: str) -> str:
    """A container command/args/env value as the kubelet passes it on (k8s.io expansion.Expand): `$$` -> `$`,
    `$(NAME)` -> a variable's value (here every name counts as defined), `$(` unclosed stays."""
    out, i = [], 0
    while i < len(value):
        if value[i] == "$" and i + 1 < len(value):
            nxt = value[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(" and (end := value.find(")", i + 2)) != -1:
                out.append(f"<expanded {value[i + 2:end]}>")
                i = end + 1
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(value[i])
        i += 1
    return "".join(out)


# -- the artefacts -------------------------------------------------------------------------------------------------

ROOT = "/srv/llmc-storage"


def launch_text(scheduler: str, *, job: dict | None = None, run: str = "hostile", root: str = ROOT,
                program: list[str] | None = None, kind: str = "indexed-job", image: str | None = None,
                config: dict | None = None) -> str:
    """What `llmcluster launch --scheduler S --dry-run` prints, built in this process through the same validation
    (the job config's schema, build_spec, the scheduler's own checks)."""
    from llmcluster.config.load import validate
    from llmcluster.config.schema import JobConfig
    from llmcluster.launch.scheduler import get
    from llmcluster.launch.spec import build_spec

    cfg = validate({"run": {"name": run}, "job": job or {}, **(config or {})}, JobConfig)
    args = SimpleNamespace(scheduler=scheduler, nodes=2 if scheduler != "local" else None, gpus_per_node=None,
                           procs_per_node=None, time=None, partition=None, max_requeues=None, max_restarts=None,
                           image=image if image is not None else ("img:1" if scheduler == "k8s" else None),
                           k8s_kind=kind, namespace=None,
                           program=program or [], overrides=[])
    spec = build_spec(cfg, args, Path(root), host_paths=("/data",))
    return get(scheduler).render(spec)


def benign_of(render: Callable[[str], str], benign: str = BENIGN) -> Callable[[], str]:
    """The render of a benign value (one the field's grammar takes), made once per entry."""
    return functools.cache(lambda: render(benign))


def script_entry(render: Callable[[str], str], check: Callable[[list[list[str]], str], None],
                 differs: Callable[[str], bool], reader=None, benign: str = BENIGN) -> Callable[[str], tuple]:
    """An entry for a bash script: `render(value)` the script, `differs(line)` picks the lines of the benign
    render that carry the value, `check(words_of_those_lines, value)` asserts bash's words of them."""
    benign_text = benign_of(render, benign)

    def build(value: str):
        text, benign = render(value), benign_text()
        return text, lambda: check(check_script(text, benign, differs, reader), value)
    build.benign = benign
    return build


def yaml_entry(render: Callable[[str], str], check: Callable[[list, str], None],
               benign: str = BENIGN) -> Callable[[str], tuple]:
    """An entry for YAML: `render(value)` the documents, `check(loaded_documents, value)` asserts the field."""
    benign_text = benign_of(render, benign)

    def build(value: str):
        text, benign = render(value), benign_text()
        return text, lambda: check(check_yaml(text, benign), value)
    build.benign = benign
    return build


def export_of(name: str):
    """The check that `export NAME=...` gives NAME exactly the value."""
    def check(words: list[list[str]], value: str) -> None:
        (line,) = [w for w in words if w[:1] == ["export"] and w[1].startswith(name + "=")]
        assert line == ["export", f"{name}={value}"]
    return check


def exports(name: str):
    return lambda ln: ln.startswith(f"export {name}=")


def program_words(words: list[list[str]], value: str) -> None:
    (argv,) = [w for w in words if "--no-python" in w]
    assert argv[argv.index("--no-python") + 1:] == ["prog", value, "--flag", value]


def is_command_line(ln: str) -> bool:
    return ln.startswith(("exec ", "srun "))


def local_script(**kw) -> Callable[[str], str]:
    return lambda v: launch_text("local", **{k: f(v) for k, f in kw.items()})


def slurm_script(**kw) -> Callable[[str], str]:
    return lambda v: launch_text("slurm", **{k: f(v) for k, f in kw.items()})


FT_ON = {"ft": {"enabled": True}, "parallel": {"dp_replicate": 2}}


def slurm_ft_script(**kw) -> Callable[[str], str]:
    """The sbatch script with ft (2 replica groups of 1 node: the Lighthouse step, a relaunch loop per group)."""
    kw = {"config": lambda _: FT_ON, **kw}
    return lambda v: launch_text("slurm", **{k: f(v) for k, f in kw.items()})


def sbatch_entry(render: Callable[[str], str], key: str, want: Callable[[str], str],
                 read: Callable[[str], str] = str, benign: str = BENIGN,
                 differs: Callable[[str], bool] | None = None) -> Callable[[str], tuple]:
    """An entry for an #SBATCH value: the directive as sbatch reads it (`read`: what Slurm then makes of it)."""
    benign_text = benign_of(render, benign)

    def build(value: str):
        text, benign = render(value), benign_text()

        def parse_back():
            check_script(text, benign, differs or (lambda ln: ln.startswith(f"#SBATCH --{key}=")))
            assert read(sbatch_directives(text)[key]) == want(value)
        return text, parse_back
    build.benign = benign
    return build


def rooted(value: str) -> str:
    """The storage root a value makes (`--root ROOT/VALUE`), as the launcher holds it (a Path)."""
    return str(Path(f"{ROOT}/{value}"))


def check_root_export(words, value):
    export_of("LLMCLUSTER_STORAGE")(words, rooted(value))


def check_local_run_name(words, value):
    (argv,) = [w for w in words if w[:1] == ["exec"]]
    assert argv[argv.index("--log-dir") + 1] == f"{ROOT}/logs/{value}/ranks"


def secret_names(lines: list[str]) -> list[list[str]]:
    """`for v in NAMES; do` is no simple command for `set --`: its words as the POSIX shell splits them."""
    return [shlex.split(ln) for ln in lines]


# Kubernetes: the four forms, each object's container found by walking the documents
K8S_FORMS = ("indexed-job", "volcano", "jobset", "pytorchjob")


def pods(docs: list) -> list[dict]:
    """Every pod spec (a mapping with `containers`) anywhere in the documents."""
    found = []

    def walk(o):
        if isinstance(o, dict):
            if isinstance(o.get("containers"), list):
                found.append(o)
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(docs)
    assert found
    return found


def containers(docs: list) -> list[dict]:
    return [c for p in pods(docs) for c in p["containers"]]


def k8s_entries(form: str) -> dict[str, Callable]:
    def render(**kw):
        return lambda v: launch_text("k8s", kind=form, **{k: f(v) for k, f in kw.items()})

    def env_check(docs, value):
        for c in containers(docs):
            assert [kubelet(e["value"]) for e in c["env"] if e["name"] == "X"] == [value]

    def args_check(docs, value):
        for c in containers(docs):
            argv = [kubelet(a) for a in c["command"] + c["args"]]
            assert argv[argv.index("--no-python") + 1:] == ["prog", value, "--flag", value]

    def every(getter):
        def check(docs, value):
            got = getter(docs)
            assert got and all(g == value for g in got), got[:3]
        return check

    return {
        f"launch k8s {form}: job.env value": yaml_entry(render(job=lambda v: {"env": {"X": v}}), env_check),
        f"launch k8s {form}: program word": yaml_entry(render(program=lambda v: ["prog", v, "--flag", v]),
                                                       args_check),
        f"launch k8s {form}: run name": yaml_entry(render(run=lambda v: v),
                                                   every(lambda d: [o["metadata"]["name"] for o in d
                                                                    if o["kind"] != "ConfigMap"])),
        f"launch k8s {form}: job.k8s.namespace": yaml_entry(
            render(job=lambda v: {"k8s": {"namespace": v}}), every(lambda d: [o["metadata"]["namespace"] for o in d])),
        f"launch k8s {form}: job.image": yaml_entry(render(image=lambda v: v),
                                                    every(lambda d: [c["image"] for c in containers(d)])),
        f"launch k8s {form}: node_selector value": yaml_entry(
            render(job=lambda v: {"k8s": {"node_selector": {"pool": v}}}),
            every(lambda d: [p["nodeSelector"]["pool"] for p in pods(d)])),
        f"launch k8s {form}: toleration value": yaml_entry(
            render(job=lambda v: {"k8s": {"tolerations": [{"key": "k", "operator": "Equal", "value": v}]}}),
            every(lambda d: [p["tolerations"][0]["value"] for p in pods(d)])),
    }


def k8s_ft_entries() -> dict[str, Callable]:
    """The JobSet with ft (issue 37): the groups' pods and the Lighthouse's Deployment + Service."""
    def render(**kw):
        kw = {"config": lambda _: FT_ON, **kw}
        return lambda v: launch_text("k8s", kind="jobset", **{k: f(v) for k, f in kw.items()})

    def ranks(docs):
        return [c for c in containers(docs) if c["name"] != "lighthouse"]

    def env_is(name, want):
        def check(docs, value):
            got = [kubelet(e["value"]) for c in ranks(docs) for e in c["env"] if e["name"] == name]
            assert len(got) == 2 and set(got) == {want(value)}, got
        return check

    def args_check(docs, value):
        for c in ranks(docs):
            argv = [kubelet(a) for a in c["command"] + c["args"]]
            assert argv[argv.index("--no-python") + 1:] == ["prog", value, "--flag", value]

    def names(docs, value):
        assert {o["metadata"]["name"] for o in docs if o["kind"] != "ConfigMap"} == {value, f"{value}-lighthouse"}

    return {
        "launch k8s jobset ft: job.env value": yaml_entry(render(job=lambda v: {"env": {"X": v}}), env_is("X", str)),
        "launch k8s jobset ft: program word": yaml_entry(render(program=lambda v: ["prog", v, "--flag", v]),
                                                         args_check),
        "launch k8s jobset ft: run name (groups, Lighthouse)": yaml_entry(render(run=lambda v: v), names),
        "launch k8s jobset ft: job.image (groups, Lighthouse)": yaml_entry(
            render(image=lambda v: v),
            lambda d, v: len(containers(d)) == 3 and all(c["image"] == v for c in containers(d)) or pytest.fail("image")),
        "launch k8s jobset ft: ft.lighthouse": yaml_entry(
            render(config=lambda v: {**FT_ON, "ft": {"enabled": True, "lighthouse": v}}),
            env_is("TORCHFT_LIGHTHOUSE", lambda v: f"http://{v}"), benign="lighthouse-host:29510"),
    }


# monitor config
def prometheus(nodes=("gpu01",), interval="15s", serve=None) -> str:
    from llmcluster.monitor import scrape_config as sc
    from llmcluster.monitor import serve_targets as st_

    sc.check_scrape_flags(9400, 9401, 1, interval)
    serving = st_.from_flag(serve) if serve is not None else []
    return sc.dump(sc.prometheus_config(list(nodes), 9400, 9401, 1, interval, rules_dir=None, serving=serving))


def k8s_monitor(**kw) -> str:
    from llmcluster.monitor import scrape_config as sc

    args = {"namespace": "monitoring", "image": "img:1", "port": 9400, "train_port_name": "train-metrics",
            "expected_gpus": 0, "storage_path": "/storage", **kw}
    return sc.dump(sc.kubernetes_manifests(**args))


def targets(docs, job: str) -> list[str]:
    (cfg,) = docs
    return [t for j in cfg["scrape_configs"] if j["job_name"] == job for s in j["static_configs"] for t in s["targets"]]


def valid_target(target: str) -> bool:
    """What Prometheus takes as a target: HOST:PORT, the host a name or an address."""
    host, _, port = target.rpartition(":")
    if host.startswith("["):
        ipaddress.IPv6Address(host[1:-1])
    return port.isdigit() and 0 < int(port) < 65536 and " " not in host and host.isascii()


def node_target_check(docs, value):
    got = targets(docs, "llmcluster-node")
    assert got == [f"{value}:9400"] and all(map(valid_target, got))


def serve_name_check(docs, value):
    """--serve-endpoints is a comma-separated list of URL=NAME, blanks around items dropped: the name is the value
    stripped (none: HOST:PORT), and a ',' in it makes another item (refused unless that item is an endpoint)."""
    (cfg,) = docs
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "llmcluster-serve"]
    assert [s["labels"]["serve_name"] for s in job["static_configs"]] == [value.strip() or "gpu01:8000"]


def serve_host_check(docs, value):
    got = targets(docs, "llmcluster-serve")
    assert got == [f"{value}:8000"] and all(map(valid_target, got))


def every_doc(getter):
    def check(docs, value):
        got = [getter(d) for d in docs]
        assert all(g == value for g in got), got[:3]
    return check


# provision: the inventory and group_vars (the Ansible renderer: `!unsafe` strings)
def cluster_spec(hosts="gpu01", root="/storage"):
    from llmcluster.config.cluster import ClusterSpec
    from llmcluster.config.load import validate

    return validate({"name": "inj", "nodes": {"hosts": hosts}, "hardware": {"gpu": "none", "gpus_per_node": 0},
                     "storage": {"root": root}, "scheduler": {"default": "slurm"}}, ClusterSpec)


def provision_files(spec) -> tuple[str, str]:
    """(inventory.yml, group_vars/all/cluster.yml) as provision writes them (its own dumper and `!unsafe`)."""
    from llmcluster.provision import render

    hosts, _ = render.host_names(spec)
    head = render.head_node(spec, hosts)
    cvars, _ = render.cluster_vars(spec, hosts, head, "slurm")
    out = Path(tempfile.mkdtemp(dir=WORK))
    render._dump(out / "inventory.yml", render.inventory(spec, hosts, head), "inventory", unsafe=True)
    render._dump(out / "cluster.yml", cvars, "vars", unsafe=True)
    return (out / "inventory.yml").read_text(), (out / "cluster.yml").read_text()


def unsafe_tagged(text: str, key: str) -> bool:
    """The value of top-level `key` carries Ansible's `!unsafe` tag (composed, not constructed)."""
    node = yaml.compose(text)
    (value,) = [v for k, v in node.value if k.value == key]
    return value.tag == "!unsafe"


def provision_entry(make_spec: Callable[[str], object], key: str, want: Callable[[str], str]):
    def build(value: str):
        _, text = provision_files(make_spec(value))
        _, benign = provision_files(make_spec(BENIGN))

        def parse_back():
            assert key_paths(read_rendered_text(text)) == key_paths(read_rendered_text(benign))
            assert read_rendered_text(text)[key] == want(value)
            assert unsafe_tagged(text, key)
        return text, parse_back
    return build


def read_rendered_text(text: str):
    path = Path(tempfile.mkdtemp(dir=WORK)) / "vars.yml"
    path.write_text(text)
    return read_rendered(path)


def tampered_root(value: str):
    """A valid spec whose storage.root is then set past the grammar (as test_spec_injection does): the renderer's
    own layer must hold."""
    spec = cluster_spec()
    spec.storage.root = value
    return spec


def inventory_hosts(value: str):
    from llmcluster.config.hostlist import expand_hostlist

    spec = cluster_spec(hosts=value)
    inv, _ = provision_files(spec)

    def parse_back():
        assert list(read_rendered_text(inv)["all"]["children"]["nodes"]["hosts"]) == expand_hostlist(value)
    return inv, parse_back


def nodelist(value: str):
    """`monitor config --slurm-nodelist EXPR`: the expression expanded, every name a valid target."""
    from llmcluster.config.hostlist import expand_hostlist

    names = expand_hostlist(value)
    text, benign = prometheus(nodes=names), prometheus(nodes=[BENIGN] * len(names))

    def parse_back():
        got = targets(check_yaml(text, benign), "llmcluster-node")
        assert got == [f"{n}:9400" for n in names] and all(map(valid_target, got))
    return text, parse_back


def command_entry(render: Callable[[str], str], want: Callable[[str], list[str]]):
    """A printed copyable command: bash's words of it are the intended argv."""
    def build(value: str):
        text = render(value)

        def parse_back():
            bash_syntax(text)
            assert script_words([text]) == [want(value)]
            assert not (WORK / "pwned").exists()
        return text, parse_back
    return build


def emit_command(value: str) -> str:
    from llmcluster.plan.emit import train_command
    from llmcluster.render import line_text

    return train_command(line_text(value, "--emit-config"))   # write_job_config's check, before it writes


def apply_command(value: str) -> str:
    from llmcluster.provision.render import apply_command
    from llmcluster.render import line_text

    return apply_command(line_text(value, "--out"))            # provision's check, before it writes


# serve start (local, Slurm, Kubernetes) and the downstream evaluation job's sbatch script
def serve_job(served: str = BENIGN, name: str = "serve-m", scheduler: str = "local", root: str = ROOT):
    """A ServeJob as `serve start` builds it (the served name, the job name and the storage root through their own
    checks), without an engine or weights: a preset's shapes, a stand-in python."""
    from llmcluster.plan.served_model import from_preset
    from llmcluster.render import line_text
    from llmcluster.serve import engine as eng
    from llmcluster.serve.start import ServeJob
    from llmcluster.storage.layout import check_run_name

    served = eng.served_name(served)
    line_text(root, "storage root")
    target = eng.Target(from_preset("llm_tiny"), Path(ROOT) / "models" / served, served)
    return ServeJob(check_run_name(name), scheduler, Path(root), eng.Engine("/usr/bin/python3", "0", cpu=True),
                    target, eng.Sizing(1, "float32", 64, 4), "127.0.0.1", 8000, 1)


def served_words(words: list[list[str]], value: str) -> None:
    (argv,) = [w for w in words if "--served-model-name" in w]
    assert argv[argv.index("--served-model-name") + 1] == value
    assert argv[argv.index("--model") + 1] == str(Path(ROOT) / "models" / value)


def carries_served(ln: str) -> bool:
    return "--served-model-name" in ln or ln.startswith("# llmcluster serve start")


def serve_local(served=BENIGN) -> str:
    from llmcluster.serve.start import render_local
    return render_local(serve_job(served))


def serve_slurm(served=BENIGN, time=None, partition=None, name="serve-m", root=ROOT) -> str:
    from llmcluster.serve.start import render_slurm
    return render_slurm(serve_job(served, name=name, scheduler="slurm", root=root), time, partition)


def serve_k8s(served=BENIGN, image="vllm/vllm-openai:v0", name="serve-m") -> str:
    from llmcluster.launch.k8s import _dns
    from llmcluster.serve import engine as eng
    from llmcluster.serve.k8s import PORT, Serving, render

    job = serve_job(served, name=name, scheduler="k8s")
    _dns(job.name, "serving job name")
    argv = eng.argv(job.engine, job.target, job.sizing, job.served, "0.0.0.0", PORT)
    return render(Serving(job.name, "default", image, tuple(argv), "models", job.target.export.name,
                          f"/storage/models/{job.target.export.name}", 1, None, None, 1000, "1Gi", {}, [], True,
                          "monitoring"))


def k8s_served_check(docs, value):
    for c in containers(docs):
        argv = [kubelet(a) for a in c["command"] + c["args"]]
        assert argv[argv.index("--served-model-name") + 1] == value


EVAL_ARGV = ["/usr/bin/python3", "-m", "llmcluster", "eval", "--model", "m"]


def downstream_script(run: str = BENIGN, word: str | None = None) -> str:
    """The downstream evaluation job as it is submitted: sbatch's argv (the job name's grammar) and the script."""
    from llmcluster.train.downstream import render_sbatch, sbatch_argv

    sbatch_argv(run, 10, Path(ROOT) / "logs" / "r" / "eval" / "step_10.out", Path(ROOT) / "x.sh")
    return render_sbatch(run, 10, EVAL_ARGV + ([word] if word is not None else ["--tasks"]))


def downstream_exec(words, value):
    (argv,) = [w for w in words if w[:1] == ["exec"]]
    assert argv[1:] == EVAL_ARGV + [value]


# -- THE LIST: every field of every artefact we render -------------------------------------------------------------
# build(value) -> (artefact_text, parse_back); an optional attribute `build.benign` names a value the field takes
# when "benign" is not one (a duration, a time limit)
Build = Callable[[str], "tuple[str, Callable[[], None]]"]
RENDERERS: dict[str, Build] = {
    # launch --scheduler local: launch.sh
    "launch local: job.env value": script_entry(local_script(job=lambda v: {"env": {"X": v}}), export_of("X"),
                                                exports("X")),
    "launch local: program word": script_entry(local_script(program=lambda v: ["prog", v, "--flag", v]),
                                               program_words, is_command_line),
    "launch local: storage root": script_entry(local_script(root=lambda v: f"{ROOT}/{v}"), check_root_export,
                                               lambda ln: ROOT in ln),
    "launch local: run name": script_entry(local_script(run=lambda v: v), check_local_run_name,
                                           lambda ln: BENIGN in ln),
    # launch --scheduler slurm: job.sbatch
    "launch slurm: job.env value": script_entry(slurm_script(job=lambda v: {"env": {"X": v}}), export_of("X"),
                                                exports("X")),
    "launch slurm: program word": script_entry(slurm_script(program=lambda v: ["prog", v, "--flag", v]),
                                               program_words, is_command_line),
    "launch slurm: storage root (exports, srun, ranks dir)": script_entry(
        slurm_script(root=lambda v: f"{ROOT}/{v}"), check_root_export, lambda ln: ROOT in ln),
    "launch slurm: storage root (#SBATCH --output)": sbatch_entry(
        slurm_script(root=lambda v: f"{ROOT}/{v}"), "output", lambda v: f"{rooted(v)}/logs/hostile/slurm-7.out",
        read=slurm_filename, differs=lambda ln: ROOT in ln),
    "launch slurm: job.partition": sbatch_entry(slurm_script(job=lambda v: {"partition": v}), "partition", str),
    "launch slurm: job.account": sbatch_entry(slurm_script(job=lambda v: {"account": v}), "account", str),
    "launch slurm: job.time": sbatch_entry(slurm_script(job=lambda v: {"time": v}), "time", str,
                                           benign="01:00:00"),
    "launch slurm: job.mem_per_node": sbatch_entry(slurm_script(job=lambda v: {"mem_per_node": v}), "mem", str,
                                                   benign="4G"),
    "launch slurm: job.image (pyxis)": script_entry(
        slurm_script(image=lambda v: f"img{v}"),
        lambda words, v: [a for w in words for a in w if a.startswith("--container-image=")] == [
            f"--container-image=img{v}"] or pytest.fail("image"), is_command_line),
    "launch slurm: job.mounts (pyxis)": script_entry(
        slurm_script(image=lambda v: "img:1", job=lambda v: {"mounts": [{"source": f"/data/{v}", "path": "/d"}]}),
        lambda words, v: [a for w in words for a in w if a.startswith("--container-mounts=")] == [
            f"--container-mounts={ROOT}:{ROOT},/data/{v}:/d"] or pytest.fail("mounts"), is_command_line),
    "launch slurm: job.secret_env name": script_entry(
        slurm_script(job=lambda v: {"secret_env": [f"S{v}"]}),
        lambda words, v: words == [["for", "v", "in", f"S{v};", "do"]] or pytest.fail(str(words)),
        lambda ln: ln.startswith("for v in"), reader=secret_names),
    # launch --scheduler slurm with ft: job.sbatch's Lighthouse step and per-group steps
    "launch slurm ft: program word (a group's step)": script_entry(
        slurm_ft_script(program=lambda v: ["prog", v, "--flag", v]), program_words,
        lambda ln: ln.lstrip().startswith("srun ")),
    "launch slurm ft: storage root (exports, group steps, ranks dir)": script_entry(
        slurm_ft_script(root=lambda v: f"{ROOT}/{v}"), check_root_export, lambda ln: ROOT in ln),
    "launch slurm ft: job.image (the Lighthouse step and the groups')": script_entry(
        slurm_ft_script(image=lambda v: f"img{v}"),
        lambda words, v: [a for w in words for a in w if a.startswith("--container-image=")] == [
            f"--container-image=img{v}"] * 2 or pytest.fail("image"), lambda ln: ln.lstrip().startswith("srun ")),
    "launch slurm ft: ft.lighthouse": script_entry(
        slurm_ft_script(config=lambda v: {**FT_ON, "ft": {"enabled": True, "lighthouse": v}}),
        lambda words, v: export_of("TORCHFT_LIGHTHOUSE")(words, f"http://{v}"), exports("TORCHFT_LIGHTHOUSE"),
        benign="lighthouse-host:29510"),
    # launch --scheduler k8s: the four forms (job.yaml)
    **{name: b for form in K8S_FORMS for name, b in k8s_entries(form).items()},
    **k8s_ft_entries(),
    # monitor config: prometheus.yml, and --kubernetes's manifests
    "monitor config: --nodes host": yaml_entry(lambda v: prometheus(nodes=[v]), node_target_check),
    "monitor config: --slurm-nodelist": nodelist,
    "monitor config: --scrape-interval": yaml_entry(lambda v: prometheus(interval=v),
                                                    lambda d, v: d[0]["global"]["scrape_interval"] == v or
                                                    pytest.fail("interval"), benign="15s"),
    "monitor config: --serve-endpoints name": yaml_entry(lambda v: prometheus(serve=f"http://gpu01:8000/v1={v}"),
                                                         serve_name_check),
    "monitor config: --serve-endpoints host": yaml_entry(lambda v: prometheus(serve=f"http://{v}:8000/v1"),
                                                         serve_host_check),
    "monitor config --kubernetes: --namespace": yaml_entry(lambda v: k8s_monitor(namespace=v),
                                                           every_doc(lambda d: d["metadata"]["namespace"])),
    "monitor config --kubernetes: --image": yaml_entry(
        lambda v: k8s_monitor(image=v), lambda d, v: containers(d)[0]["image"] == v or pytest.fail("image")),
    "monitor config --kubernetes: --train-port-name": yaml_entry(
        lambda v: k8s_monitor(train_port_name=v),
        lambda d, v: d[2]["spec"]["podMetricsEndpoints"][0]["port"] == v or pytest.fail("port name")),
    "monitor config --kubernetes: --storage-path": yaml_entry(
        lambda v: k8s_monitor(storage_path=v),
        lambda d, v: d[0]["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] == v or pytest.fail("path")),
    # provision: inventory.yml and group_vars (the grammar first, then the renderer's own layer behind it)
    "provision: nodes.hosts (inventory)": inventory_hosts,
    "provision: storage.root (group_vars)": provision_entry(lambda v: cluster_spec(root=f"/storage/{v}"),
                                                           "storage_root", lambda v: f"/storage/{v}".rstrip("/")),
    "provision: storage_root past the grammar (group_vars, !unsafe)": provision_entry(
        tampered_root, "storage_root", lambda v: v.rstrip("/") or "/"),
    "provision: the printed apply command (--out)": command_entry(
        apply_command, lambda v: ["ansible-playbook", "-i", f"{v}/inventory.yml", f"{v}/site.yml"]),
    # plan --emit-config: the printed command
    "plan --emit-config: the printed command": command_entry(
        emit_command, lambda v: ["llmcluster", "train", "--config", v]),
    # serve start: the local script, the Slurm script, the Kubernetes objects (issue 32 High #1)
    "serve local: served-model name (export directory)": script_entry(serve_local, served_words, carries_served),
    "serve slurm: served-model name (export directory)": script_entry(serve_slurm, served_words, carries_served),
    "serve slurm: --time": sbatch_entry(lambda v: serve_slurm(time=v), "time", str, benign="1:00:00"),
    "serve slurm: --partition": sbatch_entry(lambda v: serve_slurm(partition=v), "partition", str),
    "serve slurm: storage root (#SBATCH --output)": sbatch_entry(
        lambda v: serve_slurm(root=f"{ROOT}/{v}"), "output", lambda v: f"{rooted(v)}/logs/serve-m/slurm-7.out",
        read=slurm_filename, differs=lambda ln: ROOT in ln),
    "serve k8s: served-model name (export directory)": yaml_entry(serve_k8s, k8s_served_check),
    "serve k8s: --image": yaml_entry(lambda v: serve_k8s(image=v),
                                     lambda d, v: [c["image"] for c in containers(d)] == [v] or pytest.fail("image")),
    "serve k8s: --name": yaml_entry(lambda v: serve_k8s(name=v), lambda d, v: [o["metadata"]["name"] for o in d] == [
        f"{v}-guard", v, v, v] or pytest.fail("name")),
    # the downstream evaluation job's sbatch script (train/downstream.py)
    "downstream eval sbatch: run name": script_entry(lambda v: downstream_script(run=v),
                                                     lambda words, v: None, lambda ln: ln.startswith("# llmcluster")),
    "downstream eval sbatch: a word of its command": script_entry(lambda v: downstream_script(word=v),
                                                                  downstream_exec, lambda ln: ln.startswith("exec ")),
}


def attempt(name: str, value: str) -> str:
    """Build `name` with `value`: 'refused' (one UserError line) or 'quoted' (parsed back exactly)."""
    try:
        _, parse_back = RENDERERS[name](value)
    except UserError as e:
        assert len(str(e).splitlines()) == 1, f"{name}: the refusal is not one line"
        assert len(str(e)) < 1000, f"{name}: the refusal echoes the whole value: {str(e)[:300]}"
        return "refused"
    parse_back()
    return "quoted"


NAMES = list(RENDERERS)


@pytest.mark.parametrize("name", NAMES)
def test_every_hostile_string_is_refused_or_rendered_exactly(name):
    outcomes = {repr(v)[:30]: attempt(name, v) for v in HOSTILE}
    plain = getattr(RENDERERS[name], "benign", BENIGN)     # a value the field's grammar takes
    assert attempt(name, plain) == "quoted", f"{name}: a plain value must render"
    assert not (WORK / "pwned").exists()
    print(name, outcomes)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(value=STRINGS)
def test_generated_strings_are_refused_or_rendered_exactly(name, value):
    attempt(name, value)
    assert not (WORK / "pwned").exists()


def test_the_list_covers_every_artefact_and_scheduler_form():
    """A renderer added to the package without an entry here is noticed: every form of launch, every monitor
    output, provision and plan are listed."""
    prefixes = ["launch local:", "launch slurm:", "monitor config:", "monitor config --kubernetes:",
                "provision:", "plan --emit-config:", "serve local:", "serve slurm:", "serve k8s:",
                "downstream eval sbatch:"] + [f"launch k8s {f}:" for f in K8S_FORMS]
    for p in prefixes:
        assert any(n.startswith(p) for n in NAMES), p
    from llmcluster.launch.k8s import FORMS

    assert set(FORMS) == set(K8S_FORMS)


# -- the specific holes, each shown failing on the old renderers ---------------------------------------------------

@pytest.mark.parametrize("render,run", [(lambda root: launch_text("slurm", root=root), "hostile"),
                                        (lambda root: serve_slurm(root=root), "serve-m")], ids=["launch", "serve"])
def test_a_percent_in_the_storage_root_lands_in_the_right_slurm_log(render, run):
    """sbatch expands %j/%u/%x in --output; the root's own '%' are doubled so the file lands under the root
    (issue 50: `serve start --scheduler slurm` did not double them: its log went to /srv/a<user>b%c/...)."""
    text = render("/srv/a%ub%%c")
    assert sbatch_directives(text)["output"] == f"/srv/a%%ub%%%%c/logs/{run}/slurm-%j.out"
    assert slurm_filename(sbatch_directives(text)["output"]) == f"/srv/a%ub%%c/logs/{run}/slurm-7.out"


def test_kubelet_expansion_cannot_reach_another_variable():
    """$(HF_TOKEN) in a job.env value or a program word would be the secret's value inside the pod (the kubelet
    expands it); ours ($(POD_NAME), $(MASTER_ADDR)) still expand."""
    docs = load_all((launch_text("k8s", kind="volcano", job={"env": {"X": "$(HF_TOKEN)"}},
                                               program=["echo", "$(HF_TOKEN)"])))
    (c,) = containers(docs)[:1]
    assert kubelet([e["value"] for e in c["env"] if e["name"] == "X"][0]) == "$(HF_TOKEN)"
    assert kubelet(c["args"][-1]) == "$(HF_TOKEN)"
    assert c["args"][c["args"].index("--rdzv-endpoint") + 1] == "$(MASTER_ADDR):$(MASTER_PORT)"
    assert any("$(POD_NAME)" in a for a in c["args"])


def test_pyxis_mount_list_separators_are_refused():
    with pytest.raises(UserError, match="separates the items"):
        launch_text("slurm", image="img:1", root="/srv/a,b")


@pytest.mark.parametrize("value", ["http://u:p@mlflow:5000", "postgresql://db/m?password=x", "api_token=abc123",
                                   "https://TOKEN@hub.example.com/x", "a\rb", "a\u2028b"])
def test_job_env_values_with_credentials_or_breaks_are_refused(value):
    from llmcluster.config.load import validate
    from llmcluster.config.schema import JobConfig

    with pytest.raises(UserError) as e:
        validate({"job": {"env": {"DB_URL": value}}}, JobConfig)
    assert "\n" not in str(e.value)
    if "\r" not in value and "\u2028" not in value:
        assert "job.secret_env" in str(e.value) and value not in str(e.value)   # the secret is not echoed


@pytest.mark.parametrize("value", ["expandable_segments:True", "^lo,docker", "monkey=1", "http://mlflow:5000/x"])
def test_ordinary_job_env_values_pass(value):
    from llmcluster.config.job import JobSpec

    assert JobSpec(env={"V": value}).env["V"] == value


@pytest.mark.parametrize("key,value", [("job.time", "0١:00:00"), ("job.mem_per_node", "4٥G"),
                                       ("job.k8s.shm_size", "1٦Gi"), ("log.metrics_bind", "0.0.0.0:9٤01")])
def test_non_ascii_digits_are_refused_by_every_job_grammar(key, value):
    from llmcluster.config.load import validate
    from llmcluster.config.schema import JobConfig

    section, *rest = key.split(".")
    inner = {rest[-1]: value}
    for k in reversed(rest[:-1]):
        inner = {k: inner}
    with pytest.raises(UserError):
        validate({section: inner}, JobConfig)


@pytest.mark.parametrize("section,values", [("monitoring", {"scrape_interval": "1٥s"}),
                                            ("nodes", {"hosts": "gpu[٠1-٠3]"})])
def test_non_ascii_digits_are_refused_by_the_cluster_grammar(section, values):
    from llmcluster.config.cluster import ClusterSpec
    from llmcluster.config.hostlist import expand_hostlist
    from llmcluster.config.load import validate

    with pytest.raises(UserError):
        validate({section: values}, ClusterSpec)
    with pytest.raises(UserError):
        expand_hostlist("gpu[٠1-٠3]")


def test_monitor_config_refuses_an_invalid_target_in_one_line(tmp_path):
    """issue 34 item 7: `monitor config --nodes "a b;touch x"` wrote an invalid target and exited 0."""
    from conftest import assert_one_line_error, run_cli

    p = run_cli("monitor", "config", "--nodes", "a b;touch x", "--out", tmp_path / "p.yml", cwd=tmp_path)
    assert_one_line_error(p, "a b;touch x", "HOST:PORT")
    assert not (tmp_path / "p.yml").exists()


def test_plan_emit_config_prints_a_command_the_shell_reads_back(tmp_path):
    """issue 34 item 7: the copyable command named the emitted file unquoted."""
    from conftest import run_cli

    out = tmp_path / "my plan $(touch pwned).yaml"
    p = run_cli("plan", "seed-a100-7b", "--emit-config", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("wrote ")]
    command = line.split(": ", 1)[1]
    assert shlex.split(command) == ["llmcluster", "train", "--config", str(out)]
    assert script_words([command]) == [["llmcluster", "train", "--config", str(out)]]
    assert out.is_file() and not (tmp_path / "pwned").exists()


def test_provision_apply_line_is_quoted():
    from llmcluster.provision.render import apply_command as apply

    assert script_words([apply("/tmp/my project")]) == [
        ["ansible-playbook", "-i", "/tmp/my project/inventory.yml", "/tmp/my project/site.yml"]]


def test_yaml_text_round_trips_multiline_and_odd_strings():
    from llmcluster.render import yaml_text

    values = ["a\nb\n", "a \nb", " lead\nx", "x\r\ny", "\u2028\n", "tab\tx\n", "\x00\n", "#x\n- y\n", "a\n\n"]
    doc = {"k": values}
    assert yaml.safe_load(yaml_text([doc])) == doc


def _both_emitters_read_back(values, monkeypatch):
    from llmcluster.render import yaml_text

    docs = [{"k": values, "env": [{"name": v, "value": v + "\n" + v} for v in values]}, {v: v for v in values}]
    with monkeypatch.context() as m:
        m.delattr(yaml, "CSafeDumper", raising=False)
        pure = yaml_text(docs)
    fast = yaml_text(docs)
    assert list(yaml.load_all(pure, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))) == docs
    assert list(yaml.load_all(fast, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))) == docs


def test_libyaml_and_pure_python_emitters_both_round_trip_the_hostile_list(monkeypatch):
    """yaml_text emits through libyaml where PyYAML has it (CI's does; the suite above runs on it) and through
    PyYAML's own emitter elsewhere: both read back exactly with every hostile string as a key, a value and in a
    multi-line block. (Their text may differ where YAML allows two spellings: an empty key is `'':` in one and
    `? ''` in the other.)"""
    _both_emitters_read_back(HOSTILE, monkeypatch)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(STRINGS, max_size=6))
def test_libyaml_and_pure_python_emitters_both_round_trip_generated_strings(monkeypatch, values):
    _both_emitters_read_back(values, monkeypatch)
