"""Run under torchrun by test_preset_shapes.py: the trainer's FSDP model (no activation checkpointing) with
`parallel.fsdp_reshard_after_forward` true and false, each given one warm-up step, then one training step
(forward and backward) under CommDebugMode; prints, as one JSON line per rank, how many all-gathers that step
issued at each setting."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from llmcluster.config.load import load_job_config
from llmcluster.distributed import process_groups as D
from llmcluster.train.parallelize import build_parallel_model

cfg = load_job_config("llm_tiny", sys.argv[1:])
dims = D.ParallelDims.from_config(cfg, int(os.environ["WORLD_SIZE"]))
env = D.init_distributed(cfg, need_group=True)
tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(env.rank))


def step(model) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


record = {"rank": env.rank, "torch": torch.__version__}
for reshard in (True, False):
    cfg.parallel.fsdp_reshard_after_forward = reshard
    model, _ = build_parallel_model(cfg, dims, env, cfg.run.seed)
    step(model)  # the first step also runs FSDP's lazy initialisation
    comm = CommDebugMode()
    with comm:
        step(model)
    record[f"all_gathers_reshard_{str(reshard).lower()}"] = sum(
        n for op, n in comm.get_comm_counts().items() if "gather" in str(op))
print(json.dumps(record), flush=True)
# Teardown is not under test (torch 2.6 can hang one rank in destroy_process_group): leave once every rank
# is past every collective, as tests/meta_init_worker.py does.
store = dist.distributed_c10d._get_default_store()
store.set(f"gather_done{env.rank}", "1")
store.wait([f"gather_done{r}" for r in range(env.world_size)])
os._exit(0)
