"""The CUDA path: NCCL, FSDP2's bf16 MixedPrecisionPolicy, fused AdamW, logits parity with transformers.

Skipped without a GPU (nothing here can be emulated on CPU); `benchmarks/gpu_check.sh` runs them on one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmcluster.config.schema import JobConfig, ModelConfig, TrainConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = ModelConfig(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=512,
                    max_seq_len=128)


def cfg(**parallel) -> JobConfig:
    return JobConfig(model=SHAPE, train=TrainConfig(precision="bf16", device="cuda", lr=1e-3, warmup_steps=0),
                     data={"seq_len": SHAPE.max_seq_len}, parallel={"dp_replicate": 1, "dp_shard": 1, **parallel})


@pytest.fixture(scope="module")
def nccl():
    """A one-rank NCCL group, made the way the trainer makes it (init_distributed)."""
    import torch.distributed as dist

    from llmcluster.distributed import process_groups as D

    env = D.init_distributed(cfg(), need_group=True)
    assert env.device.type == "cuda" and dist.get_backend() in ("nccl", "cuda:nccl,cpu:gloo")
    yield env
    D.shutdown()


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, SHAPE.vocab_size, (4, 65), generator=g).cuda()
    return xy[:, :-1], xy[:, 1:]


def test_nccl_one_rank_all_reduce(nccl):
    import torch.distributed as dist

    t = torch.full((4,), 3.0, device="cuda")
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4


def test_fsdp_bf16_policy_step_matches_autocast(nccl):
    """FSDP on one rank with bf16 params/compute and fp32 reduce vs plain bf16 autocast: same loss to bf16
    precision, fp32 master weights kept, and the step changes them."""
    from llmcluster.model.llama import build_model
    from llmcluster.distributed.process_groups import ParallelDims
    from llmcluster.train.optimizer import build_optimizer
    from llmcluster.train.parallelize import parallelize

    c = cfg(dp_shard=-1)
    dims = ParallelDims.from_config(c, 1)
    assert dims.fsdp
    sharded = parallelize(build_model(SHAPE, "cpu", seed=1).cuda(), c, dims, nccl)
    plain = build_model(SHAPE, "cpu", seed=1).cuda()
    x, y = batch()
    logits = sharded(x)
    assert logits.dtype == torch.bfloat16  # computed in bf16 by the policy, no autocast around it
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = plain(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    ref_loss = F.cross_entropy(ref.float().flatten(0, 1), y.flatten())
    assert abs(loss.item() - ref_loss.item()) < 2e-2
    before = {n: p.full_tensor().clone() for n, p in sharded.named_parameters()}
    assert all(p.dtype == torch.float32 for p in before.values())
    opt = build_optimizer(sharded, c.train, nccl.device)
    loss.backward()
    opt.step()
    changed = [n for n, p in sharded.named_parameters() if not torch.equal(p.full_tensor(), before[n])]
    assert len(changed) == len(before)


def test_fused_adamw_matches_foreach():
    from llmcluster.model.llama import build_model
    from llmcluster.train.optimizer import build_optimizer

    a, b = (build_model(SHAPE, "cpu", seed=2).cuda() for _ in range(2))
    opt_a = build_optimizer(a, cfg().train, torch.device("cuda"))
    assert opt_a.defaults["fused"] is True
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    for group in opt_a.param_groups:
        group["weight_decay"] = 0.0
    for s in range(3):
        x, y = batch(s)
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=n)


def test_logits_match_transformers_on_cuda():
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmcluster.model.llama import build_model

    torch.backends.cuda.matmul.allow_tf32 = False
    ours = build_model(SHAPE, "cpu", seed=3).cuda().eval()
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=SHAPE.vocab_size, hidden_size=SHAPE.d_model, intermediate_size=SHAPE.ffn_hidden,
        num_hidden_layers=SHAPE.n_layers, num_attention_heads=SHAPE.n_heads,
        num_key_value_heads=SHAPE.kv_heads, max_position_embeddings=SHAPE.max_seq_len,
        rms_norm_eps=SHAPE.norm_eps, rope_theta=SHAPE.rope_theta, tie_word_embeddings=False)).cuda().eval()
    # Names map one to one: HF's are ours under "model." (lm_head stays at the top).
    sd = {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    x, _ = batch()
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(input_ids=x).logits, rtol=1e-4, atol=1e-4)
