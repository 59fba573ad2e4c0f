"""validate on a shared cluster: `--drain` never for a failure every node shows, never more than
--max-drain nodes at once, and the scontrol commands printed. scontrol is a stand-in (no slurmctld to
drain in here; the commands it receives are what is checked); storage checks sized from the free space
and the number of nodes writing at once."""

from __future__ import annotations

import subprocess

from llmcluster.validate.result import FAIL, PASS, WARN, CheckResult
from llmcluster.validate.run import drain_capped


def result(check: str, host: str, status: str) -> CheckResult:
    r = CheckResult(check, node=host)
    r.add(f"{check} item", status, "x", "2% of expected" if status == FAIL else "")
    return r


def fake_run(seen):
    def run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_a_failure_on_every_node_drains_none(capsys):
    hosts = [f"gpu{i:02d}" for i in range(1, 21)]
    results = [result("storage", h, FAIL) for h in hosts] + [result("compute", h, PASS) for h in hosts]
    seen: list = []
    r = drain_capped(results, CheckResult("compare"), None, run=fake_run(seen))
    assert seen == [], "a shared cause (a slow filesystem) drained nodes"
    assert any(i.name == "shared storage" and i.status == WARN for i in r.items)


def test_one_bad_node_is_drained_and_the_command_printed(capsys):
    hosts = [f"gpu{i:02d}" for i in range(1, 21)]
    results = [result("compute", h, FAIL if h == "gpu07" else PASS) for h in hosts]
    seen: list = []
    drain_capped(results, CheckResult("compare"), None, run=fake_run(seen))
    assert [c[2] for c in seen] == ["nodename=gpu07"]
    assert "drain:  scontrol update nodename=gpu07 state=drain 'reason=llmcluster validate:" in capsys.readouterr().out


def test_more_flagged_than_max_drain_drains_none_but_prints_the_commands(capsys):
    hosts = [f"gpu{i:02d}" for i in range(1, 21)]
    bad = {"gpu02", "gpu05", "gpu09"}                 # 3 > 10% of 20
    results = [result("compute", h, FAIL if h in bad else PASS) for h in hosts]
    seen: list = []
    r = drain_capped(results, CheckResult("compare"), None, run=fake_run(seen))
    assert seen == [] and r.items[0].status == WARN and "--max-drain 2" in r.items[0].detail
    out = capsys.readouterr().out
    assert all(f"would drain:  scontrol update nodename={h} state=drain" in out for h in bad), out
    drain_capped(results, CheckResult("compare"), 3, run=fake_run(seen))
    assert sorted(c[2] for c in seen) == [f"nodename={h}" for h in sorted(bad)]


def test_storage_files_are_sized_from_free_space_and_node_count(tmp_path):
    """A nearly full shared filesystem is not filled by the check: all nodes together write at most 5% of
    the free space; too little free space is a SKIP, not a full disk."""
    from llmcluster.validate.spec import load_spec
    from llmcluster.validate.storage import MIB, check_storage, file_size

    gib = 1 << 30
    assert file_size(1000 * gib, 1, quick=False) == 2 * gib              # plenty: the default
    assert file_size(100 * gib, 8, quick=False) == 640 * MIB              # 8 nodes share 5% of 100 GiB
    assert file_size(100 * gib, 8, quick=False, size=4 * gib) == 640 * MIB   # --storage-size is capped too
    assert file_size(1 * gib, 16, quick=True) == 0                        # 3.2 MiB each: skipped
    # a real check on this machine's disk: the bytes written per node follow the same rule
    (tmp_path / "checkpoints").mkdir()
    r = check_storage(tmp_path, load_spec(None), quick=True, nodes=4)
    row = r.data["areas"][0]
    import shutil
    assert row["bytes"] <= max(shutil.disk_usage(tmp_path).free * 0.05 / 4, 0) and row["bytes"] <= 64 * MIB
