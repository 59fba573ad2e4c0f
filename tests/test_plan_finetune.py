"""The planner's fine-tuning table (plan/finetune.py, issue 55): full / LoRA fp32 / LoRA bf16 / QLoRA, AdamW or
8-bit states, with or without offload; its model-state bytes against the trainer's real objects; published rows."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from llmcluster.plan.finetune import finetune_table, model_state_bytes
from llmcluster.plan.spec import ModelSpec, ParallelSpec, PlanCluster, PlanSpec

MID = dict(n_layers=4, d_model=512, n_heads=8, n_kv_heads=4, ffn_hidden=1536, vocab_size=4096, seq_len=256)


def _row(rows, method, optimizer="adamw", offload=False):
    return next(r for r in rows if (r.method, r.optimizer, r.offload) == (method, optimizer, offload))


def test_cli_table_and_json_exit_0_and_the_presets_fit():
    proc = run_cli("plan", "rtx4090-8b-qlora", "--finetune", "--json", check=True)
    rows = json.loads(proc.stdout)["rows"]
    assert len(rows) == 16
    ok = {(r["method"], r["optimizer"], r["offload"]) for r in rows if r["fits"]}
    assert ("qlora", "adamw", False) in ok and ("full", "adamw", False) not in ok   # 8B: QLoRA fits one 4090
    proc = run_cli("plan", "rtx4090-70b-qlora", "--finetune", check=True)     # a comparison: exit 0
    assert "qlora      adamw      yes     yes" in proc.stdout, proc.stdout


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
    from llmcluster.train import qlora
    from llmcluster.train.optimizer import build_optimizer

    def nbytes(t) -> int:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
            return t.numel() * t.element_size()
        names, _ = t.__tensor_flatten__()
        return sum(nbytes(getattr(t, n)) for n in names)

    lora = None if method == "full" else LoraConfig(rank=8, targets=list(qlora.LINEARS),
                                                      base_precision="bf16" if base == "nf4" else base)
    cfg = JobConfig(model={k: v for k, v in MID.items() if k != "seq_len"},
                    train=TrainConfig(lora=lora, optimizer=optimizer, precision="bf16"))
    model = build_model(cfg.model, device="cpu")
    if lora:
        apply_lora(model, lora)
        qlora.prepare_base(model, cfg, torch.device("cpu"), 1)
    if base == "nf4":
        nf4 = qlora.nf4_module()
        for name in qlora.nf4_weight_names(model):
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


def _published(model: dict, gpus: int, gpu: str, seq: int, batch: int, ac: str = "full"):
    return finetune_table(PlanSpec(model=ModelSpec(**model, seq_len=seq),
                                   cluster=PlanCluster(gpu=gpu, nodes=1, gpus_per_node=gpus),
                                   parallel=ParallelSpec(micro_batch=batch, activation_checkpoint=ac)))


def test_published_rows():
    """torchtune's QLoRA tutorial: Llama-2-7B in under 10 GB (recipe qlora_single_device: batch 2, activation
    checkpointing, rank 8; https://pytorch.org/torchtune/stable/tutorials/qlora_finetune.html). Answer.AI with
    Dettmers and Hugging Face, March 2024 (https://www.answer.ai/posts/2024-03-06-fsdp-qlora.html): Llama-2-70B on
    2 x 24 GB (fsdp_qlora: context 512, batch 2, gradient checkpointing, CPU offload)."""
    llama2_7b = dict(n_layers=32, d_model=4096, n_heads=32, ffn_hidden=11008, vocab_size=32000)
    row = _row(_published(llama2_7b, 1, "A100-80GB", 512, 2), "qlora")
    assert row.peak_gb < 10, row
    llama2_70b = dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=32000)
    rows = _published(llama2_70b, 2, "RTX4090", 512, 2)
    assert _row(rows, "qlora", offload=True).fits and not _row(rows, "lora-bf16", offload=False).fits
