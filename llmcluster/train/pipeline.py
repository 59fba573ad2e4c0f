"""Pipeline parallelism with `torch.distributed.pipelining`, as torchtitan lays it out.

The pp dimension is the outermost of the mesh (pp, dp_replicate, dp_shard, tp). Each pp rank builds the
Llama on the meta device and deletes what its stages do not hold (blocks not in its stages; the embedding
unless it has stage 0; the final norm and head unless it has the last stage): what is left, the *rank
model*, keeps the full model's parameter names, so a DCP checkpoint written at one pp degree loads at any
other (and at pp=1). Each stage is a `_Stage` over modules of the rank model; with interleaved 1F1B a rank
has `virtual_stages` of them (stage i on rank i mod pp, Megatron's looped placement). TP, activation
checkpointing and compile apply to the rank model's blocks as without PP; FSDP wraps each block and then
each stage (its own FSDP root, which is what `PipelineStage` expects).

Weights: every rank walks every weight of `Llama.init_weights` but draws only what it holds (each weight's
values depend on the seed and its name alone), so a run at pp=2 starts from the same weights as one process.
The loss is the mean over micro-batches of the per-micro-batch mean, which is what gradient accumulation
without PP computes: the loss function divides each micro-batch's loss by the micro-batch count before
backward and the schedule's own division of the gradients is off (torchtitan's `scale_grads=False` with a
rescaled loss). Dividing before backward, not after, keeps the backward's magnitudes those of accumulation
without PP: under fp16 the same loss scale then overflows (or not) at the same step as in one process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from llmcluster.config.schema import JobConfig
from llmcluster.config.stages import stage_layers
from llmcluster.model.llama import build_model, document_mask
from llmcluster.distributed.compat import pp_schedule_kwargs
from llmcluster.distributed.process_groups import DistEnv, ParallelDims
from llmcluster.train.parallelize import (_fill_own_shard, apply_fsdp, apply_tp_ac_compile, fsdp_mesh, plain,
                                          step_context)


class _Stage(nn.Module):
    """One pipeline stage: [embedding] → its blocks → [norm → head]. Shares modules with the rank model."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool, seq_len: int):
        super().__init__()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in blocks})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._model = [model]  # not a submodule: the RoPE tables stay the rank model's (materialised there)
        # Under TP + sequence parallelism the hidden states between stages are sharded on the sequence, so
        # the RoPE length is the data's, not the input's (without SP they are whole on every TP rank).
        self.seq_len = seq_len

    def forward(self, h: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens`: the micro-batch's tokens, given to every stage when the model has a document mask (see
        `Pipeline.step`), from which each stage builds the same mask that the whole model would."""
        m = self._model[0]
        cos, sin = m.rope_cos[:self.seq_len], m.rope_sin[:self.seq_len]
        mask = None if tokens is None else document_mask(tokens, m.cfg.doc_mask_id)
        if self.embed_tokens is not None:
            h = self.embed_tokens(h)
        for block in self.layers.values():
            h = block(h, cos, sin) if mask is None else block(h, cos, sin, mask=mask)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


@dataclass
class Pipeline:
    schedule: object          # a torch.distributed.pipelining schedule
    stages: list              # this rank's PipelineStage objects
    model: nn.Module          # the rank model (optimizer, checkpoint, clip)
    pp_group: object
    has_first: bool
    has_last: bool
    n_microbatches: int
    loss_ctx: object = contextlib.nullcontext   # step_context: loss_parallel (TP), SDPA's order, fwd and bwd

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> list[torch.Tensor]:
        """One pass over the rank's whole batch (n_microbatches × micro-batch), which every pp rank reads. The
        per-micro-batch losses on the rank with the last stage, [] elsewhere.

        A document mask needs the tokens in every stage, while only the first stage receives them as input.
        Every pp rank already holds the same batch, so each passes it as a keyword argument: the schedule
        splits keyword arguments into micro-batches like the inputs and hands each stage its own ("kwargs can
        be passed to all stages via respective step calls", PipelineStage.forward_one_chunk). No integer
        tensor then travels in the stages' activations and their gradients, and nothing more is sent."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        target = y if self.has_last else None
        kwargs = {"tokens": x} if self.model.cfg.doc_mask_id is not None else {}
        run = self.schedule.step if train else self.schedule.eval
        with self.loss_ctx():
            run(*args, target=target, losses=losses if self.has_last else None, **kwargs)
        return losses


def stage_ids(dims: ParallelDims, pp_rank: int) -> list[int]:
    """The global stage indices on one pp rank: pp_rank, pp_rank + pp, ... (looped placement)."""
    return [pp_rank + v * dims.pp for v in range(dims.virtual_stages)]


def build_pipeline(cfg: JobConfig, dims: ParallelDims, env: DistEnv, seed: int | None, loss_fn) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    mesh = dims.build_mesh(env.device.type)
    n_stages = dims.pp * dims.virtual_stages
    split = stage_layers(cfg.model.n_layers, n_stages)
    mine = stage_ids(dims, dims.pp_rank(env.rank))
    held = {str(i) for s in mine for i in split[s]}

    model = build_model(cfg.model, device="meta")
    # Set aside what this rank does not hold (still on meta): init_weights walks the whole model in order.
    spare: dict[str, nn.Module] = {k: model.layers[k] for k in list(model.layers) if k not in held}
    for k in spare:
        del model.layers[k]
    ends = {"embed_tokens": 0 in mine, "norm": n_stages - 1 in mine, "lm_head": n_stages - 1 in mine}
    for name, keep in ends.items():
        if not keep:
            spare[name] = getattr(model, name)
            setattr(model, name, None)

    apply_tp_ac_compile(model, cfg, dims, mesh, env.device)
    parts = [_Stage(model, split[s], s == 0, s == n_stages - 1, cfg.data.seq_len) for s in mine]
    if dims.fsdp:
        dp_mesh = fsdp_mesh(mesh, dims)
        # The schedule runs each stage forward once per micro-batch: blocks resharded after forward would be
        # gathered again for every micro-batch's forward and backward. Kept gathered for the whole step (as
        # torchtitan under PP; the stage resharded them after the last backward): one all-gather per block
        # per step, whatever parallel.fsdp_reshard_after_forward says.
        for part in parts:
            apply_fsdp(part, dp_mesh, env.device, cfg.train.precision, reshard=False)

    model.to_empty(device=env.device)
    _init_held_weights(model, spare, seed)

    pp_group = mesh["pp"].get_group()
    stages = [PipelineStage(part, s, n_stages, env.device, group=pp_group) for part, s in zip(parts, mine)]
    m = cfg.train.grad_accum
    # Under TP the last stage's logits are sharded on the vocabulary and `loss_fn` computes on them under
    # loss_parallel; the schedule (its loss list, the trainer's sums) gets the replicated loss as a plain tensor.
    fn = loss_fn
    loss_fn = lambda logits, y: plain(fn(logits, y))  # noqa: E731
    if dims.pp_schedule == "1F1B":
        schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=loss_fn, **pp_schedule_kwargs(Schedule1F1B))
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn,
                                           **pp_schedule_kwargs(ScheduleInterleaved1F1B))
    return Pipeline(schedule, stages, model, pp_group, 0 in mine, n_stages - 1 in mine, m,
                    step_context(dims, env.device))


def _init_held_weights(model: nn.Module, spare: dict[str, nn.Module], seed: int | None) -> None:
    """Run the model's own seeded init over the whole (partly meta) model, drawing only what this rank holds."""
    for name, module in spare.items():
        if name in ("embed_tokens", "norm", "lm_head"):
            setattr(model, name, module)
        else:
            model.layers[name] = module
    order = sorted(model.layers, key=int)
    model.layers = nn.ModuleDict({k: model.layers[k] for k in order})

    def fill(param: torch.Tensor, draw) -> None:
        if not param.is_meta:  # a weight this rank does not hold is never drawn
            _fill_own_shard(param, draw)

    try:
        model.init_weights(seed, fill=fill)
    finally:
        for name in spare:
            if name in ("embed_tokens", "norm", "lm_head"):
                setattr(model, name, None)
            else:
                del model.layers[name]


def bubble_fraction(pp: int, virtual_stages: int, n_microbatches: int) -> float:
    """Share of a pipelined step that a stage idles: (p-1) / (v·m + p-1) (Narayanan et al. 2021)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual_stages * n_microbatches + pp - 1)


def grad_scaler(device: torch.device, enabled: bool, pipe: Pipeline | None):
    """The fp16 loss scaler. Under PP it is torch's ShardedGradScaler over the pp group, for two reasons:

    - Every pp rank unscales gradients that the *last* stage's scale produced, so the scales must stay
      identical on all pp ranks. `GradScaler.step/update` decide skip-and-back-off from this rank's own
      gradients only; an overflow in one stage would make that stage skip and halve its scale while the others
      step and keep theirs. ShardedGradScaler all-reduces `found_inf` over its process group in `unscale_`, so
      every stage skips together and the scales never diverge. (Across dp/tp the DTensor gradients' found_inf
      is already reduced by DTensor, torch >= 2.5.)
    - `unscale_` requires the scale to exist, and it is created lazily by `scale()`: only the last stage ever
      scales a loss, so the other ranks initialise it here with a `scale()` of their own (a throwaway one).
    """
    if pipe is None or not enabled:
        return torch.amp.GradScaler(device.type, enabled=enabled)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device.type, process_group=pipe.pp_group)
    scaler.scale(torch.ones((), device=device))
    return scaler


def pp_all_reduce_(t: torch.Tensor, pipe: Pipeline | None) -> torch.Tensor:
    """Sum over the pp ranks (each holds a different part of the model)."""
    if pipe is not None:
        dist.all_reduce(t, group=pipe.pp_group)
    return t


def bubble_note(dims, grad_accum: int) -> str:
    """The start line's note on the pipeline bubble ("" without PP)."""
    if dims.pp == 1:
        return ""
    b = bubble_fraction(dims.pp, dims.virtual_stages, grad_accum)
    return f" (includes the pipeline bubble: {100 * b:.1f}% of each step idle per stage)"
