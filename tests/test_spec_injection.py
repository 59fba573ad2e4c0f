"""A cluster spec is data: no string of it runs as code on the nodes, on the machine that applies the playbook,
or in slurmctld's configuration (issue 23, break 1; docs/security.md).

Two layers, each tested on its own:
  * the spec's grammar (config/cluster.py), whatever the scheduler: every reader (`cluster show`, `provision`,
    `plan`, `launch`) refuses a hostile value in one line, exit 2, before anything is written;
  * the renderers, in case a value ever gets past the grammar: group_vars/inventory strings are `!unsafe`, the
    shell scripts `| quote`, the systemd unit doubles `%` and `$`. These tests take a validated spec, put the
    payload into it afterwards (the renderer's own root check switched off for the purpose), render with the
    real roles and run them with Ansible and bash. Each also runs once with the layer removed from the rendered
    copy and sees the payload run: the test can fail. A harmless marker file proves whether a payload ran.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from ansible_helpers import playbook, read_rendered
from conftest import assert_one_line_error, cli_inprocess, run_cli

from llmcluster.config.cluster_load import load_cluster
from llmcluster.provision import render


def write_spec(tmp_path: Path, hosts: str = "localhost", root: str | None = None, sched: str = "slurm",
               **sections: dict) -> Path:
    """A one-node CPU cluster spec (JSON is YAML), with `sections` merged into it."""
    data = {"name": "inj", "nodes": {"hosts": hosts}, "hardware": {"gpu": "none", "gpus_per_node": 0},
            "storage": {"root": root or f"{tmp_path}/storage"}, "scheduler": {"default": sched}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(data))
    return path


# -- layer 1: the grammar, through the CLI ----------------------------------------------------------------------

@pytest.mark.parametrize("hosts", ["gpu01\nPrologSlurmctld=/tmp/x", "x y"])
@pytest.mark.parametrize("command", ["cluster show", "provision", "plan", "launch"])
def test_host_names_are_rfc1123_for_every_reader(tmp_path, hosts, command):
    """`nodes.hosts` becomes NodeName= lines in slurm.conf and topology.conf (a newline starts a slurmctld
    directive), inventory hosts and scrape targets: every command that reads the spec refuses it."""
    spec = write_spec(tmp_path, hosts=hosts)
    out = tmp_path / "out"
    args = {"cluster show": ["cluster", "show", "--cluster", spec],
            "provision": ["provision", "--cluster", spec, "--out", out],
            "plan": ["plan", "seed-a100-7b", "--cluster", spec],
            "launch": ["launch", "--cluster", spec, "--scheduler", "slurm", "--dry-run",
                       "--root", tmp_path / "storage"]}[command]
    assert_one_line_error(run_cli(*args), "nodes.hosts")
    assert not out.exists()


@pytest.mark.parametrize("section,values,needle", [
    # the old hole: storage.root was checked only when scheduler.default was not local
    ("storage", {"root": "/tmp/s;touch /tmp/llmc-marker"}, "storage.root"),
    ("storage", {"root": "/tmp/{{ lookup('pipe', 'touch /tmp/llmc-marker') }}"}, "storage.root"),
    ("storage", {"root": "/tmp/%h/$USER"}, "storage.root"),
    ("storage", {"root": "-rf"}, "storage.root"),
    ("monitoring", {"scrape_interval": "15s\nscrape_configs: []"}, "scrape_interval"),
    ("monitoring", {"scrape_interval": "1 m"}, "scrape_interval"),
    ("monitoring", {"scrape_interval": "0s"}, "scrape_interval"),
    ("scheduler", {"default": "local", "slurm": {"head_node": "head01\nSlurmctldHost=evil"}}, "head_node"),
    ("scheduler", {"default": "local", "slurm": {"head_node": "head_01"}}, "head_node"),
    ("scheduler", {"default": "local", "kubernetes": {"node_selector": {"gpu": "a b"}}}, "node_selector"),
    ("nodes", {"hosts": "gpu[01-02]", "overrides": {"gpu01\nPrologSlurmctld=/x": {"gpus_per_node": 0}}},
     "nodes.overrides"),
    ("nodes", {"hosts": "gpu[01-02]\nNodeName=evil"}, "nodes.hosts"),
    ("nodes", {"hosts": ["gpu01", "gpu_02"]}, "nodes.hosts"),
    ("nodes", {"hosts": "gpu[1-999999999]"}, "more than"),       # a typo is refused, not expanded into memory
])
def test_spec_strings_are_held_to_their_grammar_on_a_local_cluster(tmp_path, capsys, section, values, needle):
    spec = write_spec(tmp_path, sched="local", **{section: values})
    assert_one_line_error(cli_inprocess(capsys, "cluster", "show", "--cluster", spec), needle)


def test_provision_needs_an_absolute_root_whatever_the_scheduler(tmp_path):
    """`provision --scheduler slurm` on a spec whose scheduler.default is local (where a relative root is fine
    for this machine): the nodes mount the root, so it must be absolute."""
    spec = write_spec(tmp_path, root="./storage", sched="local")
    assert run_cli("cluster", "show", "--cluster", spec).returncode == 0
    for sched in ("slurm", "local"):
        proc = run_cli("provision", "--cluster", spec, "--out", tmp_path / "out", "--scheduler", sched)
        assert_one_line_error(proc, "storage.root", "absolute")
    assert not (tmp_path / "out").exists()


# -- layer 2: the renderers, with the payload put in after validation ----------------------------------------------

def tampered_project(tmp_path: Path, monkeypatch, root: str) -> Path:
    """The provision project of a valid one-node spec (localhost) whose storage root is then set to `root`."""
    spec = load_cluster(str(write_spec(tmp_path))).spec
    spec.storage.root = root                                      # past the grammar (pydantic does not re-check)
    monkeypatch.setattr(render, "check_storage_root", lambda *a: None)   # and past provision's own check
    out = tmp_path / "project"
    render.provision(spec, "", out)
    assert read_rendered(out / "group_vars" / "all" / "cluster.yml")["storage_root"] == root
    return out


def without(path: Path, text: str) -> None:
    """Remove a protection from the rendered copy (the control run: the payload must then run)."""
    body = path.read_text()
    assert text in body, text
    path.write_text(body.replace(text, ""))


@pytest.mark.slow
def test_ansible_never_templates_a_spec_value(tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    payload = f"{tmp_path}/root{{{{ lookup('pipe', 'touch {marker}') }}}}"
    # the CLI refuses the spec outright
    spec = write_spec(tmp_path, root=payload)
    assert_one_line_error(run_cli("provision", "--cluster", spec, "--out", tmp_path / "cli"), "storage.root")
    assert not (tmp_path / "cli").exists()
    # the renderer's own layer: the storage level templates storage_root in its loops (check mode: no changes)
    project = tampered_project(tmp_path, monkeypatch, payload)
    args = ["--check", "--tags", "storage", "site.yml"]
    run = playbook(project, *args)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert not marker.exists()
    assert f"(item={payload})" in run.stdout                      # it arrived, literally
    # control: the same project without `!unsafe` runs the payload on this (the applying) machine
    without(project / "group_vars" / "all" / "cluster.yml", "!unsafe ")
    playbook(project, *args)
    assert marker.exists()


HARNESS = """- name: Render the node scripts and the exporter unit as the roles do (template module, real vars)
  hosts: localhost
  gather_facts: false
  vars_files: [roles/scheduler/defaults/main.yml]
  tasks:
    - name: The prolog
      ansible.builtin.template:
        src: roles/scheduler/templates/node-check.sh.j2
        dest: "{{ dest }}/{{ item.name }}.sh"
        mode: "0755"
      loop: [{name: prolog, checks: stack}]
    - name: The exporter unit
      ansible.builtin.template:
        src: roles/monitoring/templates/llmcluster-monitor.service.j2
        dest: "{{ dest }}/llmcluster-monitor.service"
        mode: "0644"
"""
STUB = """#!/bin/bash
printf '%s\\n' "$@" >> {log}
{body}
"""


def render_node_files(project: Path, dest: Path, llmcluster: Path, scontrol: Path) -> None:
    (project / "harness.yml").write_text(HARNESS)
    dest.mkdir(exist_ok=True)
    run = playbook(project, "-i", "inventory.yml", "-e", f"dest={dest}", "-e", f"scheduler_llmcluster={llmcluster}",
                   "-e", f"scheduler_scontrol={scontrol}", "harness.yml")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def stub(path: Path, log: Path, body: str) -> Path:
    path.write_text(STUB.format(log=log, body=body))
    path.chmod(0o755)
    return path


@pytest.mark.slow
def test_node_check_and_exporter_unit_take_the_root_as_data(tmp_path, monkeypatch):
    """The prolog (Slurm runs it as root on every node) with stub `llmcluster` and `scontrol` executables: the
    root reaches llmcluster as one literal argument and its `;touch` never runs; the unit doubles `%` and `$`."""
    marker = tmp_path / "MARKER"
    root = f"{tmp_path}/root;touch {marker};%h$USER"
    assert_one_line_error(run_cli("provision", "--cluster", write_spec(tmp_path, root=root, sched="local"),
                                  "--out", tmp_path / "cli", "--scheduler", "slurm"), "storage.root")
    project = tampered_project(tmp_path, monkeypatch, root)
    calls = tmp_path / "llmcluster.args"
    scontrol_calls = tmp_path / "scontrol.args"
    llmc = stub(tmp_path / "llmcluster", calls, 'echo "FAIL stack: stub says no"; exit 1')
    scontrol = stub(tmp_path / "scontrol", scontrol_calls, "exit 0")
    dest = tmp_path / "rendered"
    render_node_files(project, dest, llmc, scontrol)

    def prolog() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(dest / "prolog.sh")], cwd=tmp_path, capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "localhost"}, timeout=60)

    p = prolog()
    assert p.returncode == 1, p.stderr                              # FAIL: the node is drained, the job requeued
    assert not marker.exists()
    args = calls.read_text().splitlines()
    assert args[args.index("--root") + 1] == root                  # one argument, byte for byte
    reason = scontrol_calls.read_text()
    assert "update\nnodename=localhost\nstate=drain\nreason=llmcluster prolog: FAIL stack: stub says no\n" in reason
    # the unit: systemd would expand %h and $USER whatever the quoting, so they are doubled
    unit = (dest / "llmcluster-monitor.service").read_text()
    exec_start = [ln for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    assert len(exec_start) == 1
    assert f"--root {tmp_path}/root;touch {marker};%%h$$USER --expected-gpus 0" in exec_start[0]
    assert re.search(r"ExecStart=\S+/bin/llmcluster monitor serve --bind 0.0.0.0 --port 9400 ", exec_start[0])
    # control: the same prolog rendered without `| quote` runs the payload
    without(project / "roles" / "scheduler" / "templates" / "node-check.sh.j2", "--root {{ storage_root | quote }}")
    tpl = project / "roles" / "scheduler" / "templates" / "node-check.sh.j2"
    tpl.write_text(tpl.read_text().replace("--quick  2>&1", "--quick --root {{ storage_root }} 2>&1"))
    render_node_files(project, dest, llmc, scontrol)
    prolog()
    assert marker.exists()
