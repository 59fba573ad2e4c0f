"""Every torch call whose signature or home changed between the floor (`TORCH_FLOOR`) and today's torch.

Each wrapper asks torch what it has (a signature, an attribute), never which version it is: a backport or a
nightly then takes the path it can run. The table of which torch added what lives in docs/compat.md; the
proof is `make test-compat`, which runs the distributed training tests on the floor torch.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from llmcluster.floor import TORCH_FLOOR  # noqa: F401  (re-exported: the one home is torch-free)


@functools.cache
def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def ddp_kwargs_without_buffer_sync() -> dict:
    """DDP that does not broadcast buffers before each forward: `forward_sync_buffers=False` where it exists
    (torch 2.13 deprecated the old name), else the older `broadcast_buffers=False` (same behaviour)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if _accepts(DDP.__init__, "forward_sync_buffers"):
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def distribute_local(full: torch.Tensor, mesh, placements):
    """A DTensor of `full` in which each rank keeps its own slice of its own copy (no communication):
    every rank drew the same seeded weight. Without `src_data_rank` (torch < 2.7) DTensor scatters rank 0's
    copy instead: the same values, one collective more."""
    from torch.distributed.tensor import distribute_tensor

    if _accepts(distribute_tensor, "src_data_rank"):
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    return distribute_tensor(full, mesh, placements)


def dcp_load(state: dict, storage_reader, planner=None, no_dist: bool = False) -> None:
    """`dcp.load`, told `no_dist` (load in one process without a process group) where it takes that
    argument (torch >= 2.7); older DCP infers the same from whether a process group exists, so the argument
    is dropped there. Every DCP load goes through here: a bare `no_dist=` is a TypeError on the floor."""
    import torch.distributed.checkpoint as dcp

    kwargs = {"storage_reader": storage_reader}
    if planner is not None:
        kwargs["planner"] = planner
    if _accepts(dcp.load, "no_dist"):
        kwargs["no_dist"] = no_dist
    dcp.load(state, **kwargs)


def pp_schedule_kwargs(schedule_cls) -> dict:
    """Keyword arguments that make a pipelining schedule leave gradients as the loss function made them:
    `scale_grads=False` where the schedule has it (torch >= 2.7 divides gradients by the micro-batch count
    after backward by default); older schedules never divide, which is the same thing."""
    return {"scale_grads": False} if _accepts(schedule_cls.__init__, "scale_grads") else {}


def fsdp2():
    """(fully_shard, MixedPrecisionPolicy): public in torch.distributed.fsdp from 2.6; before that the
    composable path (kept so an error names the floor instead of an ImportError)."""
    _cpu_stream_events()
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    _copy_out_keeps_versions()
    _hsdp_average_without_gloo_avg()
    return fully_shard, MixedPrecisionPolicy


def _cpu_stream_events() -> None:
    """FSDP2 records and waits on events of the device's streams. torch.cpu.Stream gained no-op
    `record_event`/`wait_event` in 2.7 (pytorch#145935: "now I can use FSDPv2 on CPU"); on 2.6 FSDP2 on CPU
    dies with "'Stream' object has no attribute 'record_event'". CPU work is synchronous, so the same no-ops
    are exact; added only where torch lacks them (CUDA streams are untouched). `record_event` hands back a
    (no-op) torch.cpu.Event rather than None: 2.6's HSDP asserts that its all-reduce recorded an event (2.7
    exempted CPU from that assert instead)."""
    stream = torch.cpu.Stream
    if not hasattr(stream, "record_event"):
        stream.record_event = lambda self, event=None: event if event is not None else torch.cpu.Event()
    if not hasattr(stream, "wait_event"):
        stream.wait_event = lambda self, event: None


def _copy_out_keeps_versions() -> None:
    """FSDP2 writes each all-gather into the buffers its unsharded parameters view. On CPU that copy
    (`split_with_sizes_copy.out`) bumps their autograd version counter; CUDA's fast path does not
    (pytorch#132014, #136303). A block resharded after forward is gathered again for backward, so on CPU every
    weight its forward saved is then "modified by an inplace operation" and the first backward dies. Torch after
    2.6 hides the bump itself (`_unsafe_preserve_version_counter` around the copy, the fix that followed
    pytorch#137921); 2.6 does not. Where FSDP's copy-out lacks it, the same is done around the call: each
    buffer's version is put back to what it was before (0 for one just created). Nothing else writes these
    buffers, and the all-gather gives them exactly the data the shards hold, so autograd's check guards nothing
    here. Where nothing bumped (CUDA) the restore is a no-op."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod
    except ImportError:  # before 2.6: the composable path (refused by the floor check anyway)
        return
    copy_out = group_mod.foreach_all_gather_copy_out
    if getattr(copy_out, "_keeps_versions", False) or \
            "_unsafe_preserve_version_counter" in inspect.unwrap(copy_out).__code__.co_names:
        return
    set_version = torch._C._autograd._unsafe_set_version_counter

    @functools.wraps(copy_out)
    def copy_out_keeping_versions(all_gather_result, fsdp_params, group):
        before = {id(t): t._version for p in fsdp_params for t in p.all_gather_outputs if not t.is_inference()}
        copy_out(all_gather_result, fsdp_params, group)
        for p in fsdp_params:
            for t in p.all_gather_outputs:
                if not t.is_inference():
                    set_version(t, before.get(id(t), 0))

    copy_out_keeping_versions._keeps_versions = True
    group_mod.foreach_all_gather_copy_out = copy_out_keeping_versions


@functools.cache
def _gloo_all_reduce_takes_avg() -> bool:
    """Whether gloo's all_reduce accepts ReduceOp.AVG (torch 2.6's refuses: "Cannot use ReduceOp.AVG with
    Gloo"). Asked of a one-rank gloo group of this process: no peer, no collective with other ranks."""
    try:
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    except RuntimeError:  # no gloo device here (no usable interface): no gloo HSDP to fix either
        return True
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    try:
        pg.allreduce([torch.zeros(1)], opts).wait()
        return True
    except RuntimeError:
        return False


def _hsdp_average_without_gloo_avg() -> None:
    """HSDP averages gradients with a reduce-scatter over the shard group, then an all_reduce over the
    replicate group, both ReduceOp.AVG for fp32/bf16. Where gloo's all_reduce refuses AVG (torch 2.6), HSDP on
    CPU dies in its first backward. There FSDP is given the pre/post divide factors it already uses for fp16
    (`_get_gradient_divide_factors`): with a pre-factor of 1 both collectives SUM, and the result is divided
    by the data-parallel size after them, the same average. Only for gloo replicate groups (NCCL takes AVG)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll
    except ImportError:
        return
    factors = getattr(coll, "_get_gradient_divide_factors", None)
    if factors is None or getattr(factors, "_sums_on_gloo", False) or _gloo_all_reduce_takes_avg():
        return

    @functools.wraps(factors)
    def factors_summing_on_gloo(reduce_scatter_group, all_reduce_group, *args, **kwargs):
        out = factors(reduce_scatter_group, all_reduce_group, *args, **kwargs)
        if out == (None, None) and all_reduce_group is not None and dist.get_backend(all_reduce_group) == "gloo":
            return 1.0, float(reduce_scatter_group.size() * all_reduce_group.size())
        return out

    factors_summing_on_gloo._sums_on_gloo = True
    coll._get_gradient_divide_factors = factors_summing_on_gloo


# torch 2.13 renamed the tensor collectives (the old names warn there); older torch has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
