"""The planner's fine-tuning table (plan/finetune.py, issue 55): full / LoRA fp32 / LoRA bf16 / QLoRA, AdamW or
8-bit states, with or without offload; its model-state bytes against the trainer's real objects; its step time and
offload's PCIe time (the cluster spec's link); the published rows under their own conditions; the presets that
`plan` sizes by the method they name; the plot."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, cli_inprocess
from llmcluster.plan.finetune import Method, detail, finetune_table, model_state_bytes
from llmcluster.plan.spec import ModelSpec, ParallelSpec, PlanCluster, PlanSpec

MID = dict(n_layers=4, d_model=512, n_heads=8, n_kv_heads=4, ffn_hidden=1536, vocab_size=4096, seq_len=256)
LLAMA3_8B = dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256)


def _row(rows, method, optimizer="adamw", offload=False):
    return next(r for r in rows if (r["method"], r["optimizer"], r["offload"]) == (method, optimizer, offload))


def _json(capsys, *args) -> dict:
    proc = cli_inprocess(capsys, "plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_cli_table_and_json_exit_0_and_the_presets_fit(capsys):
    rows = _json(capsys, "rtx4090-8b-qlora", "--finetune")["rows"]
    assert len(rows) == 16
    ok = {(r["method"], r["optimizer"], r["offload"]) for r in rows if r["fits"]}
    assert ("qlora", "adamw", False) in ok and ("full", "adamw", False) not in ok   # 8B: QLoRA fits one 4090
    proc = cli_inprocess(capsys, "plan", "rtx4090-70b-qlora", "--finetune")     # a comparison: exit 0
    assert proc.returncode == 0, proc.stderr
    assert "qlora      adamw      yes     yes" in proc.stdout, proc.stdout
    assert "step s" in proc.stdout and "tokens/s" in proc.stdout and "PCIe Gen4 x16" in proc.stdout


@pytest.mark.parametrize("method, base, optimizer", [("full", None, "adamw"), ("lora", "fp32", "adamw"),
                                                     ("lora", "bf16", "adamw"), ("qlora", "nf4", "adamw"),
                                                     ("full", None, "adamw8bit"), ("qlora", "nf4", "adamw8bit")])
def test_model_states_equal_the_real_objects_within_3_percent(method, base, optimizer):
    """Parameters, gradients and optimizer states of the trainer's own objects on a mid-size shape (d_model 512,
    4 layers, ffn 1536: every projection divides NF4's blocks), counted tensor by tensor (a subclass's inner
    tensors), against the planner's bytes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from llmcluster.config.schema import JobConfig, LoraConfig, TrainConfig
    from llmcluster.model.llama import build_model
    from llmcluster.model.lora import apply_lora
    from llmcluster.checkpoint import nf4_base
    from llmcluster.train import qlora
    from llmcluster.train.optimizer import build_optimizer
    from llmcluster.train.qlora import tensor_bytes as nbytes   # a subclass's inner tensors counted as stored

    lora = None if method == "full" else LoraConfig(rank=8, targets=list(nf4_base.LINEARS),
                                                      base_precision="bf16" if base == "nf4" else base)
    cfg = JobConfig(model={k: v for k, v in MID.items() if k != "seq_len"},
                    train=TrainConfig(lora=lora, optimizer=optimizer, precision="bf16"))
    model = build_model(cfg.model, device="cpu")
    if lora:
        apply_lora(model, lora)
        qlora.prepare_base(model, cfg, torch.device("cpu"), 1)
    if base == "nf4":
        nf4 = nf4_base.nf4_module()
        for name in nf4_base.nf4_weight_names(model):
            mod, attr = name.rsplit(".", 1)
            w = model.get_submodule(mod).weight
            setattr(model.get_submodule(mod), attr, torch.nn.Parameter(nf4.to_nf4(w.data, 64, 256),
                                                                       requires_grad=False))
    opt = build_optimizer(model, cfg.train, torch.device("cpu"))
    trained = [p for p in model.parameters() if p.requires_grad]
    weights = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p) for p in trained)          # a gradient is its parameter's shape and dtype (fp32)
    if optimizer == "adamw":
        states = sum(2 * nbytes(p) for p in trained)
    else:   # what AdamW8bit's first step makes for each parameter (tensors under 4096 values: fp32)
        states = sum(nbytes(opt._new_buffer(p, True)) + nbytes(opt._new_buffer(p, False)) for p in trained)
    w, g, o = model_state_bytes(ModelSpec(**MID), method if method != "qlora" else "lora",
                                None if method == "full" else base, optimizer)
    for name, plan, real in (("weights", w, weights), ("gradients", g, grads), ("optimizer", o, states)):
        assert abs(plan - real) <= 0.03 * real, (name, plan, real)


def _plan(model: dict, gpus: int, gpu: str, **parallel) -> PlanSpec:
    return PlanSpec(model=ModelSpec(**model), cluster=PlanCluster(gpu=gpu, nodes=1, gpus_per_node=gpus),
                    parallel=ParallelSpec(**{"activation_checkpoint": "full", **parallel}))


def test_step_time_and_tokens_per_s_are_positive_and_offload_is_slower():
    """Every row of Llama-3-8B on 2 x RTX4090 (FSDP over both): a positive step and tokens/s that move the plan's
    batch in that step; offloading never speeds a method up, and a full fine-tune's states over PCIe slow it by
    more than a third; the frozen base makes LoRA's step shorter than full fine-tuning's (no weight gradients)."""
    plan = _plan(LLAMA3_8B | {"seq_len": 2048}, 2, "RTX4090", micro_batch=1, global_batch=16)
    rows = {(r.method, r.optimizer, r.offload): r for r in finetune_table(plan)}
    for r in rows.values():
        assert r.step_s > 0 and r.tokens_per_s > 0, r
        assert r.tokens_per_s * r.step_s == pytest.approx(16 * 2048)
    for (method, optimizer, offload), r in rows.items():
        if offload:
            kept = rows[method, optimizer, False]
            assert r.step_s > kept.step_s and r.pcie_gb_per_step > 0 and kept.pcie_gb_per_step == 0, (r, kept)
    assert rows["full", "adamw", True].step_s > 1.33 * rows["full", "adamw", False].step_s
    assert rows["lora-bf16", "adamw", False].step_s < 0.85 * rows["full", "adamw", False].step_s


def test_pcie_lanes_and_the_cluster_spec_override_change_offloads_time(capsys):
    """hardware.pcie_lanes / pcie_gen in the cluster spec (here --set) scale the GPU table's achieved host->device
    rate (RTX 4090: Gen4 x16, 24 GB/s) by the link's width and generation; a full fine-tune with offload at a short
    sequence is bound by those copies: x8 leaves more of them exposed, Gen5 less. Without offload nothing moves."""
    from llmcluster.config.gpus import gpu_spec, pcie_h2d_GBps

    rtx = gpu_spec("RTX4090")
    assert (pcie_h2d_GBps(rtx), pcie_h2d_GBps(rtx, lanes=8), pcie_h2d_GBps(rtx, gen=5)) == (24, 12, 48)
    assert pcie_h2d_GBps(gpu_spec("H100"), gen=4, lanes=16) == 27.5     # the table's Gen5 55, halved
    base = ["rtx4090-70b-qlora", "--finetune", "--set", "model=llm_8b_qlora", "--set", "model.seq_len=256"]
    runs = {name: _json(capsys, *base, *sets) for name, sets in (
        ("x16", []), ("x8", ["--set", "cluster.hardware.pcie_lanes=8"]),
        ("gen5", ["--set", "cluster.hardware.pcie_gen=5"]))}
    assert [runs[k]["pcie_h2d_GBps"] for k in ("x16", "x8", "gen5")] == [24, 12, 48]
    assert (runs["x8"]["pcie_lanes"], runs["gen5"]["pcie_gen"]) == (8, 5)
    full = {k: _row(r["rows"], "full", offload=True) for k, r in runs.items()}
    assert full["x8"]["pcie_s"] > 1.5 * full["x16"]["pcie_s"] > 0
    assert full["gen5"]["pcie_s"] < full["x16"]["pcie_s"]
    assert full["x8"]["step_s"] > full["x16"]["step_s"] > full["gen5"]["step_s"]
    assert full["x8"]["pcie_gb_per_step"] == full["x16"]["pcie_gb_per_step"]   # the same bytes, slower
    kept = {k: _row(r["rows"], "full")["step_s"] for k, r in runs.items()}
    assert kept["x8"] == kept["x16"] == kept["gen5"]


def _golden():
    from llmcluster.plan.tables import finetune_runs

    return finetune_runs()["runs"]


@pytest.mark.parametrize("run", _golden(), ids=lambda r: r["label"])
def test_published_rows_under_their_own_conditions(run):
    """plan/data/finetune_runs.yaml: each published run planned under its own model, sequence, batch, activation
    checkpointing, offload, GPUs and recipe stack. `within_10_percent`: every published figure within 10 %;
    `claim`: what the source states holds; `lower_bound`: the published figures are not reproduced (each row's
    `why` says what the planner leaves out): the planner's figures are below them, the run fits, and the recipe's
    own costs (its stack) only add to ours."""
    plan = _plan(run["model"], run["gpus"], run["gpu"], **run["parallel"])
    f = Method(**run["method"])
    row, _ = detail(plan, f, stack=run["stack"])
    published, claim = run.get("published", {}), run.get("claim", {})
    print(f"{run['label']}: planner {row.peak_gb:.2f} GB a GPU, {row.host_ram_gb:.1f} GB host; published {published}")
    if run["check"] == "within_10_percent":
        assert abs(row.peak_gb - published["gpu_gb"]) <= 0.10 * published["gpu_gb"], row
    elif run["check"] == "claim":
        assert row.peak_gb < claim.get("gpu_gb_under", float("inf")), row
        assert row.fits or not claim.get("fits"), row
    else:
        assert run["why"] and row.fits
        assert row.peak_gb < published["gpu_gb"] and row.host_ram_gb < published["host_gb"], row
        ours = detail(plan, f)[0]
        assert row.peak_gb > ours.peak_gb, (row, ours)


def test_answer_ai_two_cards_need_offload_and_lora_bf16_does_not_fit():
    """Answer.AI's point: on 2 x 24 GB a 70B model trains only as QLoRA, and there only with offload."""
    run = next(r for r in _golden() if r["label"].startswith("Answer.AI"))
    plan = _plan(run["model"], run["gpus"], run["gpu"], **run["parallel"])
    rows = {(r.method, r.offload): r.fits for r in finetune_table(plan, stack="hf-peft")}
    assert rows["qlora", True] and not rows["qlora", False] and not rows["lora-bf16", False]


@pytest.mark.parametrize("args", [("rtx4090-8b-qlora",), ("rtx4090-70b-qlora",),
                                  ("llm_8b_qlora", "--cluster", "rtx4090-box"),
                                  ("llm_70b_qlora", "--cluster", "rtx4090-box")])
def test_the_presets_fit_through_plain_plan(capsys, args):
    """`plan` sizes the method a plan or a job config names (training.lora / train.lora nf4, parallel.fsdp_offload):
    the two QLoRA presets fit their cards, exit 0, the reason naming the method; the plan preset and the job config
    it takes its model from agree; the job config plans without the weights its training needs (init_from)."""
    r = _json(capsys, *args)
    assert r["fits"] and r["finetune"]["method"] == "qlora", r["reason"]
    assert r["reason"].startswith("fits: qlora adamw"), r["reason"]
    assert r["memory"]["fits"] and r["compute"]["tokens_per_s_per_gpu"] > 0
    assert r["finetune"]["offload"] == ("70b" in args[0])
    twin = {"rtx4090-8b-qlora": ("llm_8b_qlora", "--cluster", "rtx4090-box"),
            "rtx4090-70b-qlora": ("llm_70b_qlora", "--cluster", "rtx4090-box")}.get(args[0])
    if twin:
        assert _json(capsys, *twin)["finetune"]["peak_gb"] == pytest.approx(r["finetune"]["peak_gb"])


def test_qlora_preset_trains_only_with_init_from_and_search_is_refused(capsys):
    """Training the QLoRA preset without its base is one line naming what to set; `--search` (pre-training's
    layouts) on a fine-tuning plan is one line pointing at --finetune; so are a fine-tuning plan with TP (the
    fine-tuning model plans FSDP alone) and a job config asking for more GPUs than its cluster has."""
    assert_one_line_error(cli_inprocess(capsys, "train", "-c", "llm_8b_qlora"),
                          "train.lora.base_precision=nf4 needs train.init_from", "--set train.init_from=DIR")
    assert_one_line_error(cli_inprocess(capsys, "plan", "rtx4090-8b-qlora", "--search"), "--finetune")
    assert_one_line_error(cli_inprocess(capsys, "plan", "rtx4090-70b-qlora", "--set", "parallel.tp=2"),
                          "planned with FSDP over every GPU")
    assert_one_line_error(cli_inprocess(capsys, "plan", "llm_70b_qlora", "--cluster", "rtx4090-box", "--set",
                                        "job.nodes=2"), "2 x 2 GPUs", "rtx4090-box has 1 x 2")


def test_the_plot_is_written(capsys, tmp_path):
    """`--finetune --plot DIR` writes finetune.png (every row's peak GB a GPU against the card) and says so."""
    proc = cli_inprocess(capsys, "plan", "rtx4090-8b-qlora", "--finetune", "--plot", tmp_path)
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "finetune.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in proc.stdout


def test_launch_checks_a_qlora_job_against_its_method(capsys):
    """`launch` (its fit check, plan/fit.py) sizes a fine-tuning job as its method: the 70B preset with offload
    goes on the box's two cards; without offload it does not fit, one line pointing at --finetune."""
    sets = ["--cluster", "rtx4090-box", "--config", "llm_70b_qlora", "--set", "train.init_from=/models/x", "--dry-run"]
    proc = cli_inprocess(capsys, "launch", *sets)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node 2" in proc.stdout
    assert_one_line_error(cli_inprocess(capsys, "launch", *sets, "--set", "parallel.fsdp_offload=false"),
                          "will not fit", "--finetune")
