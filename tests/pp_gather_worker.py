"""Run under torchrun by test_parallel_comms.py: the trainer's pipeline (pp × dp_shard, FSDP on each stage) runs one
warm-up step, then one training step of grad_accum micro-batches, counting FSDP's all-gathers; prints, as one JSON line per
rank, the all-gathers that step issued, the FSDP units holding parameters on this rank, the step's losses and
(on the last stage) the type and placements of the head's output."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from llmcluster.config.load import load_job_config
from llmcluster.model.llama import cross_entropy_sum
from llmcluster.distributed import process_groups as D
from llmcluster.train.pipeline import build_pipeline

cfg = load_job_config("llm_tiny", sys.argv[1:])
dims = D.ParallelDims.from_config(cfg, int(os.environ["WORLD_SIZE"]))
env = D.init_distributed(cfg, need_group=True)
torch.manual_seed(cfg.run.seed)
m = cfg.train.grad_accum
pipe = build_pipeline(cfg, dims, env, cfg.run.seed, lambda logits, y: cross_entropy_sum(logits, y) / y.numel() / m)
gen = torch.Generator().manual_seed(dims.dp_rank(env.rank))  # the same batch on both pp ranks of a dp rank
x = torch.randint(0, cfg.model.vocab_size, (m * cfg.train.micro_batch, cfg.data.seq_len + 1), generator=gen)
x, y = x[:, :-1], x[:, 1:]
head = {}
if pipe.model.lm_head is not None:
    pipe.model.lm_head.register_forward_hook(lambda mod, a, out: head.update(
        head_type=type(out).__name__, head_placements=[str(p) for p in getattr(out, "placements", ())],
        head_local_shape=list(getattr(out, "_local_tensor", out).shape)))
pipe.step(x, y)  # the first step also runs FSDP's lazy initialisation and the stages' shape inference
# FSDP2's own entry to its all-gathers (one per unit that gathers), as torch 2.6-2.13 name it. CommDebugMode,
# as in fsdp_gather_worker.py, fails inside the schedule (its module tracker loses the stage's parent).
gathers = []
foreach_all_gather = _fsdp_param_group.foreach_all_gather
_fsdp_param_group.foreach_all_gather = lambda *a, **k: gathers.append(1) or foreach_all_gather(*a, **k)
losses = pipe.step(x, y)
_fsdp_param_group.foreach_all_gather = foreach_all_gather
# FSDP units with parameters of their own (a middle stage's root holds none and gathers nothing)
units = sum(1 for mod in pipe.model.modules() if isinstance(mod, FSDPModule)
            for s in [mod._get_fsdp_state()] if s._fsdp_param_group is not None)
units += sum(1 for st in pipe.stages
             if isinstance(st.submod, FSDPModule) and st.submod._get_fsdp_state()._fsdp_param_group is not None)
record = {"rank": env.rank, "all_gathers": len(gathers),
          "units": units, "losses": [float(v) for v in losses],
          "loss_types": sorted({type(v).__name__ for v in losses}), **head}
print(json.dumps(record), flush=True)
store = dist.distributed_c10d._get_default_store()  # leave as fsdp_gather_worker.py does (teardown not under test)
store.set(f"pp_done{env.rank}", "1")
store.wait([f"pp_done{r}" for r in range(env.world_size)])
os._exit(0)
