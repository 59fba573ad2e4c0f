"""Run under torchrun by test_parallel_comms.py: the trainer's TP model (2 ranks, with or without sequence
parallelism, as the --set arguments say) computes the loss of one batch under its loss context, forward and
backward, and compares it with a plain one-process Llama holding the same (gathered) weights; prints, as one JSON
line per rank, the head's output type and placements, the final norm's weight placements, the first block's
output shape on this rank and the largest relative differences of the loss, of every gradient and of the
gradient norm the trainer clips with."""

import json
import os
import sys

import torch
import torch.distributed as dist

from llmcluster.config.load import load_job_config
from llmcluster.model.llama import build_model
from llmcluster.distributed import process_groups as D
from llmcluster.train.parallelize import build_parallel_model, clip_grad_norm, loss_context

cfg = load_job_config("llm_tiny", sys.argv[1:])
dims = D.ParallelDims.from_config(cfg, int(os.environ["WORLD_SIZE"]))
env = D.init_distributed(cfg, need_group=True)
model, raw = build_parallel_model(cfg, dims, env, cfg.run.seed)
gen = torch.Generator().manual_seed(0)  # the same batch on every rank: TP ranks share their input
x = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=gen)
y = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len), generator=gen)
y[0, :5] = -100  # untrained positions count in neither loss

head = {}
raw.lm_head.register_forward_hook(lambda m, a, out: head.update(
    head_type=type(out).__name__, head_placements=[str(p) for p in getattr(out, "placements", ())],
    head_local_shape=list(getattr(out, "_local_tensor", out).shape)))
# Between blocks: sharded on the sequence under SP, whole on every TP rank without it.
raw.layers["0"].register_forward_hook(lambda m, a, out: head.update(
    block_out_shape=list(getattr(out, "_local_tensor", out).shape)))
with loss_context(dims)():
    loss = model(x, y, cfg.train.loss_chunks)
    loss.backward()
loss = loss.detach()
grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in raw.named_parameters()}
norm = clip_grad_norm(raw.parameters(), 1e9)  # the trainer's: one norm over every parameter's DTensor gradient

ref = build_model(cfg.model)
ref.load_state_dict({n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in raw.state_dict().items()})
ref_loss = ref(x, y)
ref_loss.backward()
ref_loss = ref_loss.detach()
record = {"rank": env.rank, "loss_type": type(loss).__name__, **head,
          "loss_rel": float((loss - ref_loss).abs() / ref_loss.abs()),
          "norm_rel": float((norm - torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])).abs() / norm),
          "norm_placements": [str(p) for p in raw.norm.weight.placements],
          "grad_rel": max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max())
                          for n, p in ref.named_parameters())}
print(json.dumps(record), flush=True)
# Teardown is not under test (torch 2.6 can hang one rank in destroy_process_group), as fsdp_gather_worker.py.
store = dist.distributed_c10d._get_default_store()
store.set(f"tp_done{env.rank}", "1")
store.wait([f"tp_done{r}" for r in range(env.world_size)])
os._exit(0)
