"""`llmcluster plan` through the real CLI: every example, --json keys, --search, --calibrate, --plot, errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, assert_one_line_error, cli_env, run_cli
from llmcluster.paths import preset_path

# Every shipped plan, the fine-tuning ones (*-qlora) included: `plan` sizes the method a plan names
PLANS = sorted((REPO / "plans").glob("*.yaml"))

# The shapes of the lead's configs/llm_*.yaml presets, for a checkout where they have not landed yet.
PRESET_DIMS = {
    "llm_7b": dict(n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, vocab_size=32000, seq_len=4096),
    "llm_70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=32000,
                    seq_len=4096),
}

REQUIRED = [
    "model.params", "model.flops_per_token",
    *(f"memory.per_gpu_bytes.{k}" for k in ("weights", "gradients", "optimizer", "activations", "total")),
    "memory.gpu_capacity_bytes", "memory.fits", "compute.step_time_s", "compute.tokens_per_s_per_gpu",
    "compute.tflops_per_gpu", "compute.mfu", "time.gpu_hours", "time.days", "checkpoint.size_bytes",
    "checkpoint.write_s", "checkpoint.optimal_interval_s",
    *(f"network.switches.{k}" for k in ("leaf", "spine", "core", "total")),
    "network.bisection_bandwidth_gbps", "power.it_kw", "power.facility_kw", "power.btu_per_h", "power.racks",
    "cost.cloud_usd", "cost.onprem_capex_usd", "cost.onprem_opex_usd_per_month", "cost.break_even_months",
]


def preset_args(plan: Path) -> list[str]:
    """--set model=<dims> when the plan names a preset this checkout does not have yet."""
    model = yaml.safe_load(plan.read_text())["model"]
    if isinstance(model, str) and preset_path(model) is None:
        return ["--set", "model=" + json.dumps({"name": model, **PRESET_DIMS[model]})]
    return []


def plan_json(plan: Path, *extra: str) -> dict:
    proc = run_cli("plan", plan, "--json", *preset_args(plan), *extra, check=True)
    return json.loads(proc.stdout)


def dig(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
def test_every_example_gives_a_complete_answer(plan):
    t0 = time.perf_counter()
    r = plan_json(plan)
    print(f"{plan.name}: {time.perf_counter() - t0:.2f} s including interpreter start")  # measured, not asserted
    for key in REQUIRED:
        value = dig(r, key)
        assert value is None and key == "cost.break_even_months" or isinstance(value, (int, float)), key
    per = r["memory"]["per_gpu_bytes"]
    parts = sum(per[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers"))
    assert per["total"] == pytest.approx(parts)
    assert r["memory"]["fits"] == (per["total"] <= r["memory"]["gpu_capacity_bytes"])
    assert r["memory"]["fits"], f"{plan.name}: an example should fit"
    assert 0 < r["compute"]["mfu"] < 1
    # the run's GPU-hours are its wall time on all its GPUs
    assert r["time"]["gpu_hours"] == pytest.approx(r["time"]["days"] * 24 * r["parallel"]["world"])


def test_seed_plan_tables_and_overrides():
    plan = REPO / "plans" / "seed-a100-7b.yaml"
    proc = run_cli("plan", plan, *preset_args(plan), check=True)
    for heading in ("Memory per GPU", "Compute", "Checkpoint", "Network", "Power and cooling", "Cost", "Advice"):
        assert heading in proc.stdout
    small, big = plan_json(plan), plan_json(plan, "--set", "cluster.nodes.count=8")
    assert big["parallel"]["dp"] == 2 * small["parallel"]["dp"]
    assert big["time"]["days"] < small["time"]["days"]
    assert big["power"]["it_kw"] == pytest.approx(2 * small["power"]["it_kw"])


def test_search_70b_on_1024_gpus():
    t0 = time.perf_counter()
    r = plan_json(REPO / "plans" / "h100-70b-1024.yaml", "--search")
    print(f"--search 70B on 1024 GPUs: {time.perf_counter() - t0:.2f} s")  # measured, not asserted
    found = r["search"]
    assert found, "no configuration found"
    assert all(c["tp"] * c["pp"] * c["dp"] == 1024 for c in found)
    assert all(c["memory_bytes"] <= r["memory"]["gpu_capacity_bytes"] for c in found)
    speeds = [c["tokens_per_s_per_gpu"] for c in found]
    assert speeds == sorted(speeds, reverse=True)


def test_calibrate_with_bench_records(tmp_path):
    plan = REPO / "plans" / "rtx4090-1b.yaml"
    before = plan_json(plan)
    # no fit runs on an RTX 4090: the mean of the fitted families' residuals
    assert "mean of A100/H100 residual" in before["compute"]["efficiency_source"]
    record = {"model_params": 1.0e9, "flops_per_token": 6.4e9, "tokens_per_s_per_device": 14000.0, "mfu": 0.6,
              "peak_tflops": 165.0, "device_name": "NVIDIA GeForce RTX 4090", "precision": "bf16",
              "world_size": 2, "seq_len": 2048, "micro_batch": 4, "parallel": {"activation_checkpoint": "none"}}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(record))
    after = plan_json(plan, "--calibrate", str(bench))
    assert "bench" in after["compute"]["efficiency_source"]
    # the record's 60% of peak as a residual on the achievable rate (80% of peak without a MAMF figure)
    # at this shape, capped at 1
    c = after["compute"]
    assert c["efficiency"] == pytest.approx(min(1.0, 0.6 / (0.8 * c["gemm_efficiency"])))
    assert after["compute"]["tokens_per_s_per_gpu"] > before["compute"]["tokens_per_s_per_gpu"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mfu": 0.5}))
    assert_one_line_error(run_cli("plan", plan, "--calibrate", str(bad)), "not a bench record", "model_params")


def test_plot_writes_memory_and_cost_charts(tmp_path):
    r = plan_json(REPO / "plans" / "rtx4090-1b.yaml", "--plot", str(tmp_path))
    for name in ("memory.png", "cost.png", "step.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(png) in r["plots"]


def write_plan(tmp_path: Path, **sections) -> Path:
    base = {"model": {"n_layers": 4, "d_model": 256, "n_heads": 8, "ffn_hidden": 768, "vocab_size": 8192,
                      "seq_len": 256},
            "cluster": {"nodes": {"count": 2},
                        "hardware": {"gpu": "A100-80GB", "gpus_per_node": 4, "fabric": "ib-ndr"}}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


@pytest.mark.parametrize("sections, needles", [
    ({"cluster": {"hardware": {"gpu": "B300", "gpus_per_node": 4}}}, ["hardware.gpu", "unknown GPU 'B300'"]),
    ({"cluster": {"gpu": "A100-80GB"}}, ["'gpu' is from an old cluster format", "hardware.gpu"]),
    ({"cluster": {"nodes": 4}}, ["'nodes' is from an old cluster format", "nodes.count"]),
    ({"cost": {"pue": 1.3}}, ["cluster.cost"]),
    ({"cluster": {"nodes": {"count": 2}, "hardware": {"gpu": "none", "gpus_per_node": 0}}}, ["plans GPU clusters"]),
    ({"parallel": {"tp": 3}}, ["parallel.tp (3) must divide model.n_heads (8)"]),
    ({"parallel": {"tp": 2, "dp_replicate": 8}}, ["16 GPUs but the cluster has", "2 nodes x 4 = 8"]),
    ({"parallel": {"dp": 8}}, ["unknown key 'parallel.dp'"]),
    ({"parallel": {"zero": 4}}, ["parallel.zero"]),
    ({"cluster": {"nodez": 4}}, ["unknown key 'nodez'", "nodes"]),
    ({"parallel": {"micro_batch": 3, "global_batch": 16}}, ["global_batch (16)", "micro_batch x dp"]),
])
def test_bad_plan_is_one_line_error(tmp_path, sections, needles):
    assert_one_line_error(run_cli("plan", write_plan(tmp_path, **sections)), *needles)


def test_bad_override_and_unknown_preset_are_one_line_errors(tmp_path):
    path = write_plan(tmp_path)
    assert_one_line_error(run_cli("plan", path, "--set", "parallel.tpp=2"), "parallel.tpp", "parallel.tp")
    assert_one_line_error(run_cli("plan", path, "--set", "model=llm_nope"), "llm_nope", "not a preset")
    assert_one_line_error(run_cli("plan", tmp_path / "missing.yaml"), "plan file not found")


def test_planner_never_imports_torch():
    code = ("import sys; from llmcluster.cli import main; "
            f"rc = main(['plan', {str(REPO / 'plans' / 'rtx4090-1b.yaml')!r}, '--json', '--search']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_plan_on_a_cluster_file_needs_no_cluster_section(tmp_path):
    plan = write_plan(tmp_path)
    data = yaml.safe_load(plan.read_text())
    del data["cluster"]
    plan.write_text(yaml.safe_dump(data))
    assert_one_line_error(run_cli("plan", plan, cwd=tmp_path), "no cluster", "--cluster")
    seed = plan_json(plan, "--cluster", "seed-a100")                  # 8 hosts x 4 A100-80GB
    assert seed["parallel"]["world"] == 32
    assert plan_json(plan, "--cluster", REPO / "clusters" / "h200-8x.yaml")["parallel"]["world"] == 32
    bigger = plan_json(plan, "--cluster", "seed-a100", "--set", "cluster.nodes.count=16")
    assert bigger["parallel"]["world"] == 64
    (tmp_path / "cluster.yaml").write_text((REPO / "clusters" / "rtx4090-box.yaml").read_text())
    local = json.loads(run_cli("plan", plan, "--json", cwd=tmp_path, check=True).stdout)   # ./cluster.yaml
    assert local["parallel"]["world"] == 2
    # --cluster wins over the plan's own cluster: section (2 GPUs: the 7B does not fit, exit 3)
    box = run_cli("plan", REPO / "plans" / "seed-a100-7b.yaml", "--cluster", "rtx4090-box", "--json")
    assert box.returncode == 3 and json.loads(box.stdout)["parallel"]["world"] == 2


def test_plan_names_its_cluster_file_relative_to_itself(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.yaml").write_text("name: mine\nnodes: {count: 3}\n"
                                                 "hardware: {gpu: H100, gpus_per_node: 8, fabric: ib-ndr}\n")
    plan = write_plan(tmp_path)
    data = yaml.safe_load(plan.read_text())
    data["cluster"] = "sub/mine.yaml"
    plan.write_text(yaml.safe_dump(data))
    r = json.loads(run_cli("plan", plan, "--json", cwd=REPO, check=True).stdout)
    assert r["cluster"]["name"] == "mine" and r["parallel"]["world"] == 24
    data["cluster"] = {"base": "sub/mine.yaml", "nodes": {"count": 1}, "hardware": {"gpus_per_node": 4}}
    plan.write_text(yaml.safe_dump(data))
    assert plan_json(plan)["parallel"]["world"] == 4


def test_search_from_a_plan_without_sequence_parallelism_emits_it_for_the_trainer(tmp_path):
    """SP off (a Megatron run's layout) is a layout the trainer runs: no trainer gap, the search keeps it in its
    TP candidates' `set`, and the emitted job config says `parallel.sequence_parallel: false` and loads (a tp = 1
    candidate has nothing to switch off and says nothing). On main the plan had a gap and the search put SP back."""
    from llmcluster.config.load import load_job_config
    from llmcluster.plan.emit import write_job_config
    from llmcluster.plan.load import load_plan
    from llmcluster.plan.search import search

    plan = write_plan(tmp_path, parallel={"tp": 2, "sequence_parallel": False, "global_batch": 16})
    assert plan_json(plan)["parallel"]["trainer_gaps"] == []
    every = search(load_plan(plan), top=10_000)
    with_tp = [c for c in every if c["tp"] > 1]
    assert with_tp and all("parallel.sequence_parallel=false" in c["set"] for c in with_tp)
    assert not any("parallel.sequence_parallel" in s for c in every if c["tp"] == 1 for s in c["set"])
    cfg = load_job_config(str(write_job_config(tmp_path / "job.yaml", load_plan(plan), with_tp[0])))
    assert cfg.parallel.tp == with_tp[0]["tp"] and cfg.parallel.sequence_parallel is False


def test_plan_with_ft_prints_goodput_with_and_without_it():
    """Issue 37: `ft` in the plan's vocabulary (the job config's section); the report and --json give the
    restart path's goodput and per-group recovery's side by side, and the run's time uses ft's."""
    plan = REPO / "plans" / "seed-a100-7b.yaml"
    flags = ("--set", "ft.enabled=true", "--set", "parallel.dp_replicate=2")
    r = plan_json(plan, *flags)
    ft = r["ft"]
    assert ft["enabled"] and ft["groups"] == 2 and ft["failure_share"] == 0.5
    assert ft["goodput_ft"] > ft["goodput_restart"] and r["time"]["goodput"] == ft["goodput_ft"]
    assert ft["badput_ft"]["lost_progress"] == 0 and "ft.enabled=true" in r["parallel"]["set"]
    text = run_cli("plan", plan, *preset_args(plan), *flags, env=cli_env(COLUMNS="200"), check=True).stdout
    assert f"goodput, restart path (Young/Daly)  {ft['goodput_restart']:.2%}" in text
    assert f"goodput, per-group recovery (ft)    {ft['goodput_ft']:.2%}" in text
    off = plan_json(plan, "--set", "parallel.dp_replicate=2")      # not enabled: shown, not used
    assert off["ft"]["enabled"] is False and off["time"]["goodput"] == off["ft"]["goodput_restart"]
    assert_one_line_error(run_cli("plan", plan, *preset_args(plan), "--set", "ft.enabled=true", "--set",
                                  "parallel.dp_replicate=8"), "4 nodes", "8 replica groups")


def test_a_plan_whose_own_layout_does_not_fit_exits_3_with_the_reason_first():
    """Issue 53: `plan` of a layout that does not fit exits 3 (errors.EXIT_DOES_NOT_FIT), the verdict on its first
    line; --search answers another question (which layouts fit) and exits 0; --json carries `fits` and `reason`."""
    unfit = ("plans/seed-a100-7b.yaml", "--set", "parallel.micro_batch=16")
    proc = run_cli("plan", *unfit)
    assert proc.returncode == 3, (proc.returncode, proc.stderr)
    first = proc.stdout.splitlines()[:3]
    assert first[0].startswith("DOES NOT FIT: ") and "GiB per GPU" in first[0] and "A100-80GB" in first[0], first
    proc = run_cli("plan", *unfit, "--json")
    r = json.loads(proc.stdout)
    assert proc.returncode == 3 and r["fits"] is False and r["reason"].startswith("DOES NOT FIT"), r["reason"]
    assert run_cli("plan", *unfit, "--search").returncode == 0
    r = json.loads(run_cli("plan", "plans/seed-a100-7b.yaml", "--json", check=True).stdout)
    assert r["fits"] is True and r["reason"].startswith("fits: ")


def test_search_rows_differ_in_a_column_they_show():
    """Issue 53: with pp > 1 the trainer never reshards after forward, and the search listed both settings as two
    rows alike in every column the table shows (report.render_search's)."""
    shown = ("tp", "pp", "pp_schedule", "pp_virtual_stages", "dp_replicate", "dp_shard", "zero",
             "activation_checkpoint", "micro_batch", "grad_accum")
    for plan in ("seed-a100-70b", "h100-70b-1024"):
        rows = json.loads(run_cli("plan", f"plans/{plan}.yaml", "--search", "--json", check=True).stdout)["search"]
        keys = [tuple(r[c] for c in shown) for r in rows]
        assert len(set(keys)) == len(keys), (plan, keys)
