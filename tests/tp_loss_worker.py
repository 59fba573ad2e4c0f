"""Run under torchrun by test_parallel_comms.py: the trainer's TP model (2 ranks, sequence parallel) computes the
loss of one batch under its loss context, forward and backward, and compares it with a plain one-process Llama
holding the same (gathered) weights; prints, as one JSON line per rank, the head's output type and placements
and the largest relative differences of the loss and of every gradient."""

import json
import os
import sys

import torch
import torch.distributed as dist

from llmcluster.config.load import load_job_config
from llmcluster.model.llama import build_model
from llmcluster.distributed import process_groups as D
from llmcluster.train.parallelize import build_parallel_model, loss_context

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
with loss_context(dims)():
    loss = model(x, y)
    loss.backward()
loss = loss.detach()
grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in raw.named_parameters()}

ref = build_model(cfg.model)
ref.load_state_dict({n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in raw.state_dict().items()})
ref_loss = ref(x, y)
ref_loss.backward()
ref_loss = ref_loss.detach()
record = {"rank": env.rank, "loss_type": type(loss).__name__, **head,
          "loss_rel": float((loss - ref_loss).abs() / ref_loss.abs()),
          "grad_rel": max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max())
                          for n, p in ref.named_parameters())}
print(json.dumps(record), flush=True)
# Teardown is not under test (torch 2.6 can hang one rank in destroy_process_group), as fsdp_gather_worker.py.
store = dist.distributed_c10d._get_default_store()
store.set(f"tp_done{env.rank}", "1")
store.wait([f"tp_done{r}" for r in range(env.world_size)])
os._exit(0)
