"""The planner's formulas against published numbers (sources: docs/planning.md, "Sources")."""

from __future__ import annotations

import math

import pytest

from llmcluster.plan.calibration import foundry_plan
from llmcluster.plan.checkpoint import checkpoint, ft_recovery
from llmcluster.plan.comm import bus_bandwidth, collective_time
from llmcluster.plan.compute import efficiency_for_mfu, flops_per_token, mfu, step_time
from llmcluster.plan.memory import (count_params, layer_activation_bytes, model_states, pipeline_factor,
                                    plan_memory, stage_params)
from llmcluster.plan.network import fat_tree
from llmcluster.config.schema import DistConfig
from llmcluster.plan.spec import PlanCluster, ModelSpec, ParallelSpec, PlanSpec, TrainingSpec
from llmcluster.plan.tables import calibration
from llmcluster.plan.load import load_plan

from conftest import REPO

LLAMA2_7B = dict(n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, vocab_size=32000, seq_len=4096)
GIB = 1024**3


def test_zero_paper_model_states_7_5b_on_64_gpus():
    # ZeRO paper, figure 1: Ψ = 7.5B, N_d = 64, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB per GPU.
    got = [round(sum(model_states(7.5e9, 64, stage, "zero-paper")) / 1e9, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_deepspeed_estimator_t5_3b():
    # DeepSpeed memory.rst: t5-3b, 2851M params, 32M largest layer, 1 node x 8 GPUs (its "GB" are GiB).
    zero2 = sum(model_states(2851e6, 8, 2, "deepspeed"))
    zero3 = sum(model_states(2851e6, 8, 3, "deepspeed", unit_params=32e6))
    assert f"{zero2 / GIB:.2f}" == "15.93"
    assert f"{zero3 / GIB:.2f}" == "6.09"


def test_megatron_convention_is_18_bytes_and_distributed_optimizer_shards_12():
    assert sum(model_states(1e9, 8, 0, "megatron")) == 18e9
    assert sum(model_states(1e9, 8, 1, "megatron")) == 6e9 + 12e9 / 8


def test_llama2_7b_parameter_count():
    pc = count_params(ModelSpec(**LLAMA2_7B))
    assert pc.total == 6_738_415_616
    # No sharding: one stage holds everything; TP x PP stages add back up to the whole model.
    assert stage_params(pc, 1, 1, first=True) == pc.total
    assert stage_params(pc, 2, 1, first=True) * 2 == pc.total


def test_palm_540b_mfu():
    # PaLM appendix B: L 118, H 48, Q 256, T 2048, 238.3K tokens/s on 6144 TPU v4 (275 TFLOP/s) -> 46.2%.
    # PaLM shares its input and output embeddings (PaLM §2), so its one embedding matrix is a matmul's.
    palm = ModelSpec(n_layers=118, d_model=18432, n_heads=48, head_dim=256, ffn_hidden=73728,
                     vocab_size=256000, seq_len=2048, params=540_000_000_000, tie_embeddings=True)
    assert flops_per_token(palm) == 6 * 540e9 + 12 * 118 * 48 * 256 * 2048
    assert round(100 * mfu(flops_per_token(palm), 238.3e3, 6144, 275), 1) == 46.2


def test_llm_foundry_7b_mfu_from_its_throughput():
    # llm-foundry: MPT-7B, seq 2048, 8 x A100-80GB, 37,130 tokens/s -> 64.23% MFU; their formula is
    # (3·flops_per_seq + 3·attn_flops_per_seq)·seq_per_s / (gpus·peak) with flops_per_seq = 2·N·seq.
    row = calibration()["rows"][0]
    model = foundry_plan(row).model
    n, seq = 6_658_859_008, 2048
    foundry = (3 * 2 * n * seq + 3 * 32 * 4 * 4096 * seq**2) / seq
    assert round(100 * mfu(foundry, 37130, 8, 312), 2) == 64.23
    # the planner's count leaves out MPT's learned position embeddings (seq x d_model, a lookup) that
    # NumParams includes: 6 x 2048 x 4096 FLOPs per token fewer (0.1% at 2k; 4% for 7B at 64k)
    assert flops_per_token(model) == foundry - 6 * seq * 4096


def test_nccl_tests_busbw_example():
    # nccl-tests all_reduce_perf, 16 x H100 (2 nodes), 8 GiB: 47535 us -> algbw 180.71, busbw 338.82 GB/s.
    algbw, busbw = bus_bandwidth("all_reduce", 16, 8_589_934_592, 47535e-6)
    assert algbw == pytest.approx(180.71, abs=0.01)
    assert busbw == pytest.approx(338.82, abs=0.02)
    # and back: at that busbw the same all-reduce takes the measured time (latency aside)
    assert collective_time("all_reduce", 16, 8_589_934_592, busbw, 0.0) == pytest.approx(47535e-6)


GPT3_175B = ModelSpec(n_layers=96, d_model=12288, n_heads=96, ffn_hidden=4 * 12288, ffn_type="gelu",
                      vocab_size=51200, seq_len=2048, dropout=True)


@pytest.mark.parametrize("t", [1, 8])
def test_korthikanti_activation_variants(t):
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    lay = lambda **kw: layer_activation_bytes(GPT3_175B, s, b, tp=t, **kw)  # noqa: E731
    # Table 2 of Korthikanti et al. 2022, bytes per layer
    assert lay() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert lay(sp=t > 1) == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    assert lay(sp=t > 1, recompute="selective") == pytest.approx(34 * sbh / t)
    assert lay(recompute="full") == 2 * sbh
    # flash attention drops the 5as/h term exactly as selective recompute does
    assert lay(sp=t > 1, flash=True) == lay(sp=t > 1, recompute="selective")
    if t == 1:
        assert lay() == pytest.approx(sbh * (34 + 5 * a * s / h))


def test_activations_swiglu_and_gqa_adjustments():
    s, b = 4096, 1
    mha = ModelSpec(**LLAMA2_7B)
    gqa = ModelSpec(**{**LLAMA2_7B, "n_kv_heads": 8})
    sbh, sbf = s * b * 4096, s * b * 11008
    # dropout-free Llama layer: 8sbh kept whole, Q K V and projection input 8sbh, SwiGLU 6sbf, scores 2as²b
    assert layer_activation_bytes(mha, s, b) == 16 * sbh + 6 * sbf + 2 * 32 * s * s * b
    # GQA with 8 of 32 kv heads shrinks K and V (4sbh together) to a quarter
    assert layer_activation_bytes(mha, s, b, flash=True) - layer_activation_bytes(gqa, s, b, flash=True) == 3 * sbh


def test_pipeline_activation_factor():
    assert pipeline_factor(1, 8, "1f1b", 1) == 1
    assert pipeline_factor(8, 32, "1f1b", 1) == 8           # first stage: L layers' worth
    assert pipeline_factor(8, 4, "1f1b", 1) == 4            # fewer micro-batches than stages
    assert pipeline_factor(8, 32, "interleaved", 4) == pytest.approx(8 * (1 + 7 / 32))


def _plan(**kw) -> PlanSpec:
    base = dict(model=ModelSpec(**LLAMA2_7B), cluster=PlanCluster(gpu="A100-80GB", nodes=4, gpus_per_node=4))
    base.update(kw)
    return PlanSpec(**base)


def test_plan_memory_falls_with_sharding_and_recompute():
    totals = [plan_memory(_plan(parallel=ParallelSpec(zero=z))).total for z in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    full = plan_memory(_plan(parallel=ParallelSpec(activation_checkpoint="full")))
    half = plan_memory(_plan(parallel=ParallelSpec(activation_checkpoint="selective", ac_every=2)))
    none = plan_memory(_plan(parallel=ParallelSpec(activation_checkpoint="none")))
    # the trainer's selective AC recomputes every 2nd block whole: halfway between none and full
    assert full.activations < half.activations < none.activations
    assert half.activations == pytest.approx((full.activations + none.activations) / 2)
    assert not plan_memory(_plan(parallel=ParallelSpec(zero=0, micro_batch=8))).fits


def test_bloom_176b_checkpoint_sizes():
    # BLOOM-176B model card: bf16 weights 329 GB, full checkpoint with optimizer states 2.3 TB, as `du -h`
    # reports them (binary units, rounded up).
    bloom = ModelSpec(n_layers=70, d_model=14336, n_heads=112, ffn_hidden=4 * 14336, ffn_type="gelu",
                      vocab_size=250880, seq_len=2048, tie_embeddings=True, params=176_247_271_424)
    ck = checkpoint(PlanSpec(model=bloom, cluster=PlanCluster(gpu="A100-80GB", nodes=48)), bloom.params)
    assert math.ceil(ck.weights_bytes / 1024**3) == 329
    assert math.ceil(ck.size_bytes / 1024**4 * 10) / 10 == 2.3


def test_young_daly_interval():
    cluster = PlanCluster(gpu="A100-80GB", nodes=10, storage_write_GBps=1.0, node_mtbf_hours=1000)
    plan = _plan(cluster=cluster, training=TrainingSpec(straggler_share=0))
    ck = checkpoint(plan, 1e9)
    c, m = 14e9 / 1e9, 1000 * 3600 / 10
    assert ck.write_s == pytest.approx(c)
    assert ck.optimal_interval_s == pytest.approx(math.sqrt(2 * c * m))
    tau = ck.optimal_interval_s
    assert ck.goodput == pytest.approx(1 - (c / tau + (tau / 2 + 15 * 60 + 600) / m))
    # each failure also waits out dist.timeout_s (600 s, as PyTorch's NCCL default); no straggler share is fitted
    # (no fit run is measured on the goodput basis: plan/data/step_model.yaml), so none is charged
    default = checkpoint(_plan(cluster=cluster), 1e9, step_s=20.0)
    assert default.badput["failure"] == pytest.approx((10 + 600) / m)
    assert default.badput["hang_or_straggler"] == 0.0
    assert default.goodput == pytest.approx(1 - sum(default.badput.values()))


def test_ft_goodput_per_group_recovery_against_the_restart_path_by_hand():
    """Issue 37: 4 nodes x 4 GPUs in 2 replica groups of 2 nodes, node MTBF 1000 h (job: 250 h = 900,000 s),
    a 1e9-parameter model (14 GB of training state, written at 1 GB/s: C = 14 s, read at 20 GB/s: 0.7 s),
    restart R = 10 min, 4 NICs x 25 GB/s per node."""
    from llmcluster.config.schema import FtConfig

    cluster = PlanCluster(gpu="A100-80GB", nodes=4, gpus_per_node=4, storage_write_GBps=1.0, node_mtbf_hours=1000,
                          restart_minutes=10, nics_per_node=4, nic_GBps=25.0)
    plan = _plan(cluster=cluster, parallel=ParallelSpec(dp_replicate=2), training=TrainingSpec(straggler_share=0),
                 ft=FtConfig(enabled=True, min_replicas=1, timeout_s=10), dist=DistConfig(timeout_s=600))
    ck = checkpoint(plan, 1e9)
    m, c, read, r = 900_000.0, 14.0, 0.7, 600.0
    tau = math.sqrt(2 * c * m)                                   # 5,019.96 s
    # the restart path: every failure costs all nodes the restart, half an interval of lost work and
    # dist.timeout_s to notice it (a hung rank)
    assert ck.goodput == pytest.approx(1 - (c / tau + (tau / 2 + r + 600) / m))      # 0.993089
    ft = ft_recovery(plan, ck)
    # per-group recovery: the failed half restarts (no checkpoint read) and heals 14 GB over its 2 nodes'
    # 100 GB/s (0.07 s); the other half keeps stepping: half of (R - read + H) per failure, plus ft.timeout_s
    # for everyone to notice it; no lost work, the same checkpoint writes
    heal = 14e9 / (2 * 100e9)
    assert ft.groups == 2 and ft.share == 0.5 and ft.heal_s == pytest.approx(heal)
    assert ft.goodput == pytest.approx(1 - (c / tau + ((r - read + heal) / 2 + 10) / m))   # 0.996867
    assert ft.goodput > ck.goodput
    # min_replicas 2 of 2 groups: no step commits while one is down, the whole cluster waits for it
    strict = _plan(cluster=cluster, parallel=ParallelSpec(dp_replicate=2), training=TrainingSpec(straggler_share=0),
                   ft=FtConfig(enabled=True, min_replicas=2, timeout_s=10))
    waits = ft_recovery(strict, checkpoint(strict, 1e9))
    assert waits.share == 1.0 and waits.goodput == pytest.approx(1 - (c / tau + (r - read + heal + 10) / m))


def test_failure_detection_is_each_paths_configured_timeout():
    """Issue 52: one rule for both paths (checkpoint.failure_s): a failure costs the step in flight and the timeout
    of the collective that waits on a hung rank: dist.timeout_s for the restart path, ft.timeout_s with ft."""
    from llmcluster.config.schema import DistConfig, FtConfig

    cluster = PlanCluster(gpu="A100-80GB", nodes=4, gpus_per_node=4, node_mtbf_hours=1000)
    m = 1000 * 3600 / 4

    def failure(dist_s, ft_s):
        plan = _plan(cluster=cluster, parallel=ParallelSpec(dp_replicate=2), ft=FtConfig(enabled=True, timeout_s=ft_s),
                     dist=DistConfig(timeout_s=dist_s))
        ck = checkpoint(plan, 1e9, step_s=4.0)
        return ck.badput["failure"] * m, ft_recovery(plan, ck, 4.0).badput["failure"] * m

    assert failure(600, 10) == pytest.approx((2 + 600, 2 + 10))
    assert failure(30, 10) == pytest.approx((2 + 30, 2 + 10))          # the restart path's own timeout lowered
    assert failure(600, 5) == pytest.approx((2 + 600, 2 + 5))          # ft's: nothing else moves it
    plan = load_plan("seed-a100-7b", ["dist.timeout_s=120"])   # the job config's dist: section, as ft:
    assert plan.dist.timeout_s == 120


@pytest.mark.parametrize("nodes,dp_replicate,min_replicas,words", [
    (4, 3, 1, None),       # 3 groups on 4 nodes: refused by the mesh rule before ft's
    (2, 4, 1, ("2 nodes", "4 replica groups")),
    (4, 2, 3, ("ft.min_replicas (3)", "replica groups")),
])
def test_ft_plan_layouts_the_launchers_cannot_run_are_refused(nodes, dp_replicate, min_replicas, words):
    from pydantic import ValidationError

    from llmcluster.config.schema import FtConfig

    with pytest.raises(ValidationError) as e:
        _plan(cluster=PlanCluster(gpu="A100-80GB", nodes=nodes, gpus_per_node=4),
              parallel=ParallelSpec(dp_replicate=dp_replicate), ft=FtConfig(enabled=True, min_replicas=min_replicas))
    for w in words or ():
        assert w in str(e.value)


def test_fat_tree_sizing():
    one_switch = fat_tree(PlanCluster(gpu="A100-80GB", nodes=4, gpus_per_node=4))
    assert (one_switch.tiers, one_switch.total) == (1, 1)
    rail_leaves = fat_tree(PlanCluster(gpu="H100", nodes=32))          # 8 rails x 32: a leaf per rail
    assert (rail_leaves.tiers, rail_leaves.leaf, rail_leaves.spine) == (1, 8, 0)
    two = fat_tree(PlanCluster(gpu="H100", nodes=128))                  # per rail: 128 > 64 ports
    assert (two.tiers, two.leaf, two.spine, two.core) == (2, 8 * 4, 8 * 2, 0)
    three = fat_tree(PlanCluster(gpu="H100", nodes=4096, switch_radix=64))
    assert (three.tiers, three.leaf, three.spine, three.core) == (3, 8 * 128, 8 * 128, 8 * 64)
    assert two.bisection_bandwidth_gbps == 128 * 8 / 2 * 400


def test_efficiency_inversion_round_trips():
    plan = _plan()
    for target in (0.3, 0.5):
        assert step_time(plan, efficiency_for_mfu(plan, target)).mfu == pytest.approx(target, rel=1e-6)


def test_a_published_mfu_inverts_to_a_residual_that_reproduces_it():
    # training.mfu and bench records go through this inversion: every llm-foundry row round-trips
    for raw in calibration()["rows"]:
        plan, mfu = foundry_plan(raw), raw[4] / 100
        assert step_time(plan, efficiency_for_mfu(plan, mfu)).mfu == pytest.approx(mfu, rel=1e-6)


def test_more_gpus_per_step_never_slower_per_gpu_with_tp_inside_the_node():
    # TP over NVLink costs less than TP over the fabric: the link model must see the difference.
    inside = _plan(cluster=PlanCluster(gpu="H100", nodes=2), parallel=ParallelSpec(tp=8, zero=1))
    across = _plan(cluster=PlanCluster(gpu="H100", nodes=4, gpus_per_node=4), parallel=ParallelSpec(tp=8, zero=1))
    assert step_time(inside, 0.5).tp_s < step_time(across, 0.5).tp_s


def test_trainer_layouts_map_onto_zero_stages():
    fsdp = _plan(parallel=ParallelSpec(dp_shard=-1))
    zero2 = _plan(parallel=ParallelSpec(dp_shard=-1, fsdp_reshard_after_forward=False))
    hsdp = _plan(parallel=ParallelSpec(dp_replicate=4, dp_shard=-1))
    ddp = _plan(parallel=ParallelSpec(dp_replicate=-1, dp_shard=1))
    assert [p.zero_stage for p in (fsdp, zero2, hsdp, ddp)] == [3, 2, 3, 0]
    assert (hsdp.dp_degrees, hsdp.shard_degree, fsdp.shard_degree) == ((4, 4), 4, 16)
    mem = {name: plan_memory(p).total for name, p in (("fsdp", fsdp), ("hsdp", hsdp), ("zero2", zero2),
                                                          ("ddp", ddp))}
    # sharding over fewer ranks, or keeping gathered weights, costs memory; DDP shards nothing
    assert mem["fsdp"] < min(mem["hsdp"], mem["zero2"]) and max(mem["hsdp"], mem["zero2"]) < mem["ddp"]
    assert "parallel.dp_replicate=4" in hsdp_set(hsdp) and "parallel.dp_shard=4" in hsdp_set(hsdp)
    assert "parallel.fsdp_reshard_after_forward=false" in hsdp_set(zero2)


def hsdp_set(plan: PlanSpec) -> list[str]:
    from llmcluster.plan.analyse import job_overrides

    return job_overrides(plan)


def test_bloom_176b_published_layout_plans_with_uneven_stages():
    plan = load_plan(str(REPO / "plans" / "bloom-176b.yaml"))
    assert (plan.parallel.tp, plan.parallel.pp, plan.dp, plan.world) == (4, 12, 8, 384)
    assert plan.stage_layer_counts == [5] + [6] * 10 + [5]  # the embedding and the head count as layers
    assert plan_memory(plan).fits
    assert any("parallel.zero=1" in g for g in plan.trainer_gaps())  # ZeRO-1 is DeepSpeed's, not ours
    # its GPU-hours against the published 1,082,990: tests/test_plan_step_model.py (a validation run)


def test_tp_without_sequence_parallelism_is_plannable_with_korthikantis_figures():
    from llmcluster.plan.memory import checkpointed_layer_bytes

    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    # Korthikanti et al. 2022, Table 2: TP only s·b·h·(10 + 24/t + 5·a·s/(h·t)); TP + SP s·b·h·(34 + 5·a·s/h)/t
    no_sp = checkpointed_layer_bytes(GPT3_175B, s, b, t, 0.0, False, sequence_parallel=False)
    assert no_sp == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert checkpointed_layer_bytes(GPT3_175B, s, b, t, 0.0, False) == pytest.approx(sbh * (34 + 5 * a * s / h) / t)
    cluster = PlanCluster(gpu="A100-80GB", nodes=8)
    sp = _plan(model=GPT3_175B, cluster=cluster, parallel=ParallelSpec(tp=8, pp=8, zero=1, flash_attention=False))
    pre = _plan(model=GPT3_175B, cluster=cluster,
                parallel=ParallelSpec(tp=8, pp=8, zero=1, flash_attention=False, sequence_parallel=False))
    assert plan_memory(pre).activation_per_layer == pytest.approx(no_sp)
    assert plan_memory(pre).activations > plan_memory(sp).activations
    # the norms run on whole sequences and the pipeline sends whole activations: never faster
    assert step_time(pre, 0.8).step_s > step_time(sp, 0.8).step_s
    assert pre.trainer_gaps() == sp.trainer_gaps()   # the trainer runs TP without SP too (parallelize.py)
