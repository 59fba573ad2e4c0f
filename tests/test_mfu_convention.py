"""One parameter/FLOPs convention: bench (and the trainer) and the planner count the same FLOPs per token, so for
the same model and measured step time their MFU agree, and `plan --calibrate` takes a bench MFU as it means it."""

import json

import pytest

from conftest import run_cli
from llmcluster.config import load_job_config
from llmcluster.model import flops_per_token as bench_flops
from llmcluster.plan.compute import flops_per_token as plan_flops, mfu as plan_mfu
from llmcluster.plan.load import preset_model
from llmcluster.plan.spec import ModelSpec

SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "model.vocab_size=512", "data.seq_len=64", "train.micro_batch=2", "train.threads=1", "run.name=conv"]


@pytest.mark.parametrize("name", ["llm_tiny", "llm_7b", "llm_70b"])
@pytest.mark.parametrize("tied", [False, True])
def test_same_model_same_step_time_same_mfu(name, tied):
    cfg = load_job_config(name, [f"model.tie_embeddings={str(tied).lower()}"])
    seq = cfg.data.seq_len
    spec = ModelSpec(**{**preset_model(name), "tie_embeddings": tied, "seq_len": seq})
    # a measured step: 256 sequences of `seq` tokens in 2.5 s on 32 A100 (312 TFLOP/s bf16)
    tps, gpus, peak = 256 * seq / 2.5, 32, 312.0
    bench = bench_flops(cfg.model, seq) * tps / (gpus * peak * 1e12)      # train/bench.py's record["mfu"]
    planner = plan_mfu(plan_flops(spec), tps, gpus, peak)
    assert planner == pytest.approx(bench, rel=0.01)


def test_a_real_bench_record_and_the_planner_agree(tmp_path):
    root = tmp_path / "s"
    sets = [a for s in SMALL for a in ("--set", s)]
    run_cli("bench", "--root", root, "--config", "llm_tiny", *sets, "--set", "train.precision=fp32", "--steps", "2",
            "--warmup", "1", check=True, timeout=300)
    rec = json.loads(next((root / "logs" / "bench").glob("conv-*.json")).read_text())
    cfg = load_job_config("llm_tiny", SMALL).model
    spec = ModelSpec(**cfg.model_dump(), seq_len=rec["seq_len"])
    assert plan_flops(spec) == pytest.approx(rec["flops_per_token"], rel=1e-9)
    planner = plan_mfu(plan_flops(spec), rec["tokens_per_s"], rec["world_size"], rec["peak_tflops"])
    assert planner == pytest.approx(rec["mfu"], rel=0.01)
