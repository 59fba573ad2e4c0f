"""Run under torchrun by test_meta_init.py: build the trainer's model at a mesh (meta device → TP/FSDP →
materialise each rank's shards) and print, as one JSON line per rank, how far its weights are from the
single-process build with the same seed and how many parameter elements this rank holds: untied, then tied."""

import json
import os
import sys

import torch.distributed as dist

from llmcluster.config.load import load_job_config
from llmcluster.model.llama import build_model
from llmcluster.distributed import process_groups as D
from llmcluster.train.parallelize import build_parallel_model

env = None
for tie in ("false", "true"):   # both builds in one launch: torch and the process group start once
    cfg = load_job_config("llm_tiny", [*sys.argv[1:], f"model.tie_embeddings={tie}"])
    dims = D.ParallelDims.from_config(cfg, int(os.environ["WORLD_SIZE"]))
    env = env or D.init_distributed(cfg, need_group=True)
    _, raw = build_parallel_model(cfg, dims, env, cfg.run.seed)
    ref = build_model(cfg.model, device="cpu", seed=cfg.run.seed)
    diff, local = 0.0, 0
    for (name, p), (_, q) in zip(raw.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        diff = max(diff, (full.detach() - q).abs().max().item())
        local += (p.to_local() if hasattr(p, "to_local") else p).numel()
    print(json.dumps({"rank": env.rank, "max_abs_diff": diff, "local_numel": local,
                      "total_numel": sum(q.numel() for q in ref.parameters()),
                      "tied": raw.lm_head.weight is raw.embed_tokens.weight}), flush=True)
# Teardown is not under test here, and torch 2.6 can hang one rank in destroy_process_group after this
# DTensor work (CI, twice, even after a barrier). Once every rank is past every collective (the store
# says so), leave without it.
if dist.is_initialized():
    store = dist.distributed_c10d._get_default_store()
    store.set(f"meta_init_done{env.rank}", "1")
    store.wait([f"meta_init_done{r}" for r in range(env.world_size)])
os._exit(0)
