"""Provisioning without the internet (issue 24, break 3): the ml level installs llmcluster from a wheel the
project ships (built from the checkout, or `--wheel`), torch from a configurable index or a wheelhouse, and
slurmctld keeps its state in a directory of its own cluster."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from ansible_helpers import playbook, read_rendered
from conftest import REPO, assert_one_line_error, cli_inprocess, run_cli

from llmcluster.provision import wheel as ml_wheel


def fake_wheel(tmp_path: Path, version: str = "0.1.0", name: str = "llmcluster") -> Path:
    """A wheel with the METADATA provision reads (what it would install is not this test's business)."""
    path = tmp_path / f"{name}-{version}-py3-none-any.whl"
    reqs = ["numpy>=1.26", "torch>=2.6", "pydantic>=2.6", 'kubernetes<38,>=30; extra == "k8s"']
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in reqs))
    return path


def spec(tmp_path: Path, provision: str = "") -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: offline\nnodes: {{hosts: localhost}}\nhardware: {{gpu: none, gpus_per_node: 0}}\n"
                    f"storage: {{root: /storage}}\nscheduler: {{default: slurm}}\n{provision}")
    return path


def cluster_vars(out: Path) -> dict:
    return read_rendered(out / "group_vars" / "all" / "cluster.yml")


def test_the_given_wheel_is_shipped_and_replaces_the_last_one(tmp_path):
    out = tmp_path / "out"
    first = fake_wheel(tmp_path)
    run_cli("provision", "--cluster", spec(tmp_path), "--out", out, "--wheel", first, check=True)
    assert (out / "files" / first.name).read_bytes() == first.read_bytes()
    v = cluster_vars(out)
    assert v["provision_wheel"] == first.name and v["provision_llmcluster_version"] == "0.1.0"
    assert v["provision_requirements"] == ["numpy>=1.26", "pydantic>=2.6"]     # torch first, pinned; no extras
    # the spec can name it too; a new version replaces the old wheel in the project
    newer = fake_wheel(tmp_path, "0.2.0")
    run_cli("provision", "--cluster", spec(tmp_path, f"provision: {{wheel: {newer}}}\n"), "--out", out, check=True)
    assert sorted(p.name for p in (out / "files").glob("*.whl")) == [newer.name]
    assert cluster_vars(out)["provision_llmcluster_version"] == "0.2.0"


def test_a_wrong_or_missing_wheel_is_one_line(tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(run_cli("provision", "--cluster", spec(tmp_path), "--out", out,
                                  "--wheel", tmp_path / "nope.whl"), "no such .whl")
    other = fake_wheel(tmp_path, name="requests")
    assert_one_line_error(run_cli("provision", "--cluster", spec(tmp_path), "--out", out, "--wheel", other),
                          "not an llmcluster wheel")
    assert not out.exists()


def test_without_a_checkout_or_a_wheel_provision_refuses(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ml_wheel, "checkout", lambda: None)     # as when llmcluster was installed from a wheel
    p = cli_inprocess(capsys, "provision", "--cluster", spec(tmp_path), "--out", tmp_path / "out")
    assert_one_line_error(p, "installed package", "--wheel PATH")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("section,needle", [("provision: {torch_index: 'http://mirror/x y'}\n", "torch_index"),
                                            ("provision: {torch_index: 'file:///etc'}\n", "torch_index"),
                                            ("provision: {wheelhouse: wheels}\n", "wheelhouse")])
def test_index_and_wheelhouse_are_held_to_their_grammar(tmp_path, section, needle):
    assert_one_line_error(run_cli("cluster", "show", "--cluster", spec(tmp_path, section)), needle)


@pytest.mark.slow
def test_built_from_the_checkout_without_touching_it(tmp_path):
    def untracked() -> set[str]:
        return set(subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True,
                                  text=True, check=True).stdout.splitlines())

    before = untracked()
    out = tmp_path / "out"
    run_cli("provision", "--cluster", spec(tmp_path), "--out", out, check=True)
    (whl,) = (out / "files").glob("llmcluster-*.whl")
    version, reqs = ml_wheel.read_wheel(whl)
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
    assert "llmcluster/cli/__init__.py" in names and "llmcluster/assets/ansible/site.yml" in names
    assert version == cluster_vars(out)["provision_llmcluster_version"] and "pydantic>=2.6" in reqs
    assert not {ln for ln in untracked() - before if "build" in ln or "egg-info" in ln}   # no build/ or egg-info left


HARNESS = """- name: The ml and scheduler levels' sources, as Ansible resolves them from the rendered vars
  hosts: localhost
  gather_facts: false
  vars_files: [roles/ml/defaults/main.yml, roles/scheduler/defaults/main.yml]
  tasks:
    - name: Show
      ansible.builtin.debug:
        msg: "torch_args=[{{ ml_torch_args }}] deps_args=[{{ ml_wheelhouse_args }}] state=[{{ scheduler_state_dir }}]"
"""


@pytest.mark.slow
def test_torch_index_wheelhouse_and_slurm_state_reach_the_levels(tmp_path):
    out = tmp_path / "out"
    index = "https://mirror.example.org/whl/cpu"
    run_cli("provision", "--cluster", spec(tmp_path, f"provision: {{torch_index: '{index}'}}\n"), "--out", out,
            "--wheel", fake_wheel(tmp_path), check=True)
    (out / "harness.yml").write_text(HARNESS)

    def resolved(*extra: str) -> str:
        p = playbook(out, "-i", "inventory.yml", *extra, "harness.yml", timeout=120)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
        return p.stdout

    shown = resolved()
    assert f"torch_args=[--extra-index-url {index}] deps_args=[]" in shown
    assert "state=[/var/spool/slurmctld/offline]" in shown          # not another cluster's StateSaveLocation
    shown = resolved("-e", "provision_wheelhouse=/storage/wheelhouse")   # what provision.wheelhouse renders
    wheelhouse = "--no-index --find-links /storage/wheelhouse"
    assert f"torch_args=[{wheelhouse}] deps_args=[{wheelhouse}]" in shown
    run_cli("provision", "--cluster", spec(tmp_path, "provision: {wheelhouse: /storage/wheelhouse}\n"), "--out", out,
            "--wheel", fake_wheel(tmp_path), check=True)
    assert cluster_vars(out)["provision_wheelhouse"] == "/storage/wheelhouse"
