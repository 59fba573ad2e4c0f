"""Apply parallelism to a plain model, in torchtitan's order: float8 conversion → TP → activation checkpointing →
compile → FSDP (or DDP). The model file knows nothing of any of this.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import warnings

import torch
from torch import nn

from llmcluster.config.schema import JobConfig
from llmcluster.distributed import compat
from llmcluster.distributed.process_groups import DistEnv, ParallelDims


def uses_loss_parallel(dims: ParallelDims) -> bool:
    """TP keeps the logits sharded on the vocabulary into the loss (torch's `loss_parallel`, as torchtitan):
    no TP rank gathers the B·T·V logits or computes the whole softmax (with PP: the last stage's)."""
    return dims.tp > 1


def loss_context(dims: ParallelDims):
    """The context that forward *and* backward of the model's loss run in: `loss_parallel` (its cross-entropy
    on vocabulary-sharded logits and that op's backward) when `uses_loss_parallel`, else nothing."""
    if uses_loss_parallel(dims):
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel
    return contextlib.nullcontext


def step_context(dims: ParallelDims, device: torch.device):
    """The context every forward and backward of a step runs in: `loss_context`, and SDPA's backend order
    (train/attention.py) around both, so activation checkpointing's recompute picks the forward's kernel."""
    from llmcluster.train.attention import device_order, sdpa_priority

    loss, order = loss_context(dims), device_order(device)

    @contextlib.contextmanager
    def context():
        with loss(), sdpa_priority(order):
            yield
    return context


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool = False, sequence_parallel: bool = True) -> None:
    """Megatron-style TP: attention and MLP column- then row-parallel. With `sequence_parallel` the norms are
    sharded on the sequence (activations sharded on the sequence between blocks, so the norms and residual adds
    are not computed tp times over); without it (Megatron's layout before SP) the activations between blocks
    are whole on every TP rank and each rank computes the norms in full. `loss_parallel`: the head's output
    stays a DTensor sharded on the vocabulary (see `uses_loss_parallel`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    between = Shard(1) if sequence_parallel else Replicate()   # the hidden states' layout between modules
    head = (ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
            if loss_parallel else ColwiseParallel(input_layouts=between, output_layouts=Replicate()))
    top = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between), "lm_head": head}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    # A pipeline stage's rank model lacks the ends it does not hold (train/pipeline.py).
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k) is not None})
    if not sequence_parallel and model.norm is not None:
        _replicate(model.norm, tp_mesh)
    for block in model.layers.values():
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan |= {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, plan)
        if not sequence_parallel:
            _replicate(block.input_layernorm, tp_mesh)
            _replicate(block.post_attention_layernorm, tp_mesh)
    if loss_parallel:
        model.register_forward_hook(lambda module, args, out: plain(out))


def _replicate(module: nn.Module, tp_mesh) -> None:
    """A module every TP rank computes in full on whole activations (a norm without SP). Its weights still
    become DTensors, replicated on the TP mesh, so that every parameter of the model is a DTensor on one mesh
    (the gradient norm and FSDP's 2-D sharding take them together); its input and output stay plain tensors.
    Each rank's weight gradient is then the whole gradient (its input's gradient is already summed over the
    TP group by the column-parallel layer after it), so none is reduced."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    distribute_module(
        module, tp_mesh,
        input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
                                                 for t in inputs),
        output_fn=lambda mod, out, mesh: out.to_local())


def plain(t: torch.Tensor) -> torch.Tensor:
    """A model's result as a plain tensor: the loss (replicated, read locally: no communication) or, when
    called without targets, the logits gathered whole."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def apply_ac(model: nn.Module, mode: str, every: int) -> None:
    """full: recompute every block in backward; selective: every `every`-th block of the whole model, by its
    index (so a pipeline stage recomputes the same blocks as one process would)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        if mode == "full" or (mode == "selective" and int(name) % every == 0):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def _compiler(env_var: str, names: tuple[str, ...]) -> str | None:
    """The reason no compiler is found: $env_var if set (as the toolchains read it), else any of `names`."""
    chosen = os.environ.get(env_var)
    if shutil.which(chosen) if chosen else any(shutil.which(n) for n in names):
        return None
    return f"${env_var}={chosen} not found" if chosen else f"none of {', '.join(names)} on PATH"


def compile_available(device: torch.device) -> str | None:
    """None if torch.compile can work here, else the reason it cannot. Inductor builds C++ for the CPU
    backend; on CUDA, Triton builds a C launcher for each kernel at run time with $CC, clang or gcc (a
    `-runtime` container has none): without a compiler the first compiled forward would raise."""
    if device.type == "cpu" and (why := _compiler("CXX", ("g++", "c++", "clang++"))):
        return f"no C++ compiler for inductor's CPU backend ({why})"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        if why := _compiler("CC", ("clang", "gcc", "cc")):
            return f"no C compiler for Triton to build its kernels ({why})"
    return None


def apply_compile(model: nn.Module, device: torch.device) -> bool:
    """Compile each block separately (the repeated structure compiles once and is reused) and the head's loss
    (model/loss.py: in one piece with its backward, or each slice's loss and gradients)."""
    reason = compile_available(device)
    if reason:
        warnings.warn(f"train.compile=true ignored: {reason}; running eager", stacklevel=2)
        return False
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
    model.compile_loss = True
    return True


def apply_fsdp(model: nn.Module, dp_mesh, device: torch.device, precision: str, reshard: bool,
               offload: bool = False) -> None:
    fully_shard, MixedPrecisionPolicy = compat.fsdp2()
    mp = MixedPrecisionPolicy()
    extra = {}
    if offload:   # parameters, gradients, optimizer states in (pinned) host memory; a CPU run: no change
        from torch.distributed.fsdp import CPUOffloadPolicy
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    if device.type == "cuda" and precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        # Compute in low precision, reduce gradients in fp32 (the all-reduce sums many ranks' values).
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    # FSDP2 warns when a wrapped module returns a view ("an in-place op on this view ... can cause backward to fail
    # or produce wrong gradients"): the hazard is an in-place op on that output, which drops the pre-backward hook.
    # Ours are never modified in place (the model rebinds h = block(h), the residual adds and the head are
    # out-of-place, the returned loss is only divided out of place), so it does not apply to our modules; anyone
    # else's still warns.
    # (FSDP2 names the class it made, FSDP<ours>: FSDPLlama under FSDP x TP, where the loss comes back as a view)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \((FSDP)?(Block|Llama|OptimizedModule)\) "
                            "returned a view", category=UserWarning)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block is resharded by the root's post-backward anyway: keeping it gathered saves one
        # all-gather at the start of backward.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard and i < len(blocks) - 1,
                    **extra)
    # The root (embedding, final norm, head) is the first thing backward needs: resharding it after forward
    # only gathers it again at once. torch 2.6 always keeps the root gathered (and refuses None); 2.13 keeps
    # it only for None and honours True. False means the same on both (as torchtitan's root, left at default).
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, **extra)


def apply_tp_ac_compile(model: nn.Module, cfg: JobConfig, dims: ParallelDims, mesh, device) -> None:
    """TP -> AC -> compile, in place and in this order (torchtitan's), before FSDP wraps the result."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], uses_loss_parallel(dims), cfg.parallel.sequence_parallel)
    if cfg.parallel.activation_checkpoint == "auto":   # a mode of its own would silently checkpoint nothing
        raise ValueError("parallel.activation_checkpoint=auto is resolved before the model is built "
                         "(train/resources.py: resolve_activation_checkpoint)")
    if cfg.parallel.activation_checkpoint != "none":
        apply_ac(model, cfg.parallel.activation_checkpoint, cfg.parallel.ac_every)
    if cfg.train.compile:
        apply_compile(model, device)


def fsdp_mesh(mesh, dims: ParallelDims):
    """FSDP's mesh: HSDP (replicate x shard) when dp_replicate > 1, else the shard dimension alone."""
    return mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]


def parallelize(model: nn.Module, cfg: JobConfig, dims: ParallelDims, env: DistEnv) -> nn.Module:
    from llmcluster.train import qlora

    mesh = dims.build_mesh(env.device.type) if env.distributed else None
    apply_tp_ac_compile(model, cfg, dims, mesh, env.device)
    if cfg.parallel.fsdp_offload and not (dims.fsdp and mesh is not None):
        from llmcluster.errors import UserError
        raise UserError(f"parallel.fsdp_offload needs FSDP, and this run has none ({dims.describe()}): "
                        "set parallel.dp_shard > 1 or drop fsdp_offload")
    if dims.fsdp and mesh is not None and not qlora.unsharded_nf4(cfg, dims):
        apply_fsdp(model, fsdp_mesh(mesh, dims), env.device, cfg.train.precision,
                   cfg.parallel.fsdp_reshard_after_forward, cfg.parallel.fsdp_offload)
    elif dims.ddp and mesh is not None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The only buffers are the RoPE tables, computed identically on every rank: broadcasting them before
        # each forward is a wasted collective that also makes every rank wait for the slowest one mid-forward.
        model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                    process_group=mesh["dp_replicate"].get_group(),
                    **compat.ddp_kwargs_without_buffer_sync())
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP (FSDP2, TP, AC and compile modify modules in place or inside `layers`)."""
    return model.module if hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel) \
        else model


def build_parallel_model(cfg: JobConfig, dims: ParallelDims, env: DistEnv,
                         seed: int | None) -> tuple[nn.Module, nn.Module]:
    """(the parallelized model, the plain Llama inside it). Built on the meta device and given memory only
    after TP/FSDP have split it, so no process ever holds more than its shards plus the one weight being
    drawn (or, for a QLoRA base, quantized: train/qlora.py): a 70B model never exists whole anywhere. Seeded weights do not depend on the mesh (see
    `Llama.init_weights`), so runs at different meshes start from the same point."""
    from llmcluster.model.llama import build_model

    from llmcluster.train import qlora

    raw = build_model(cfg.model, device="meta")
    if cfg.train.lora is not None:  # adapters exist before sharding, so FSDP shards them with their block
        from llmcluster.model.lora import apply_lora, init_lora
        apply_lora(raw, cfg.train.lora)
        line = qlora.prepare_base(raw, cfg, env.device, dims.dp_shard if dims.fsdp else 1)  # nf4: on meta
        if env.is_main:
            print(line, flush=True)
    if cfg.train.float8 is not None:  # before TP/AC/compile/FSDP wrap the Linear layers (torchtitan's order)
        from llmcluster.train.float8 import apply_float8
        n = apply_float8(raw, cfg.train.float8, env.device)
        if env.is_main:
            print(f"float8 ({cfg.train.float8.recipe}{', emulated' if cfg.train.float8.emulate else ''}): "
                  f"{n} Linear layers converted (the LM head stays in {cfg.train.precision})", flush=True)
    sharded = dims.fsdp or dims.tp > 1
    model = parallelize(raw, cfg, dims, env) if sharded else raw
    if sharded and env.is_main and (line := qlora.shard_line(raw)):
        print(line, flush=True)
    # NF4 (already sharded as NF4): each weight read whole and quantized, this rank's rows kept, one at a time
    qlora.quantize_base(raw, cfg, env.device)
    qlora.materialize(raw, env.device)   # to_empty, NF4 weights kept as quantized
    if cfg.model.tie_embeddings and raw.lm_head.weight is not raw.embed_tokens.weight:
        raw.lm_head.weight = raw.embed_tokens.weight  # to_empty allocates each module's parameters apart
    raw.init_weights(seed, fill=qlora.skip_nf4(_fill_own_shard))
    if cfg.train.lora is not None:
        init_lora(raw, seed, fill=_fill_own_shard)
    if not sharded:  # DDP broadcasts rank 0's weights when it wraps: they must be real by then
        model = parallelize(raw, cfg, dims, env)
    return model, raw


@torch.no_grad()
def _fill_own_shard(param: torch.Tensor, draw) -> None:
    """Fill `param` from a seeded `draw(rows, cols)` (see `Llama.init_weights`): a DTensor draws only the rows
    and columns of its own slice, on the host, and copies them into its local tensor (no communication)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        param.to_local().copy_(draw(*shard_indices(param)).view(param.to_local().shape))
    else:
        param.copy_(draw())


def shard_indices(param) -> tuple[torch.Tensor, torch.Tensor]:
    """The global row and column indices of the (shape[0], rest) view of a DTensor that this rank holds, in
    its local order. DTensor itself splits two skinny index tensors (an expanded arange, no copy of the
    weight), so FSDP's and TP's placements, uneven and strided splits included, are read, not re-derived."""
    mesh, placements, shape = param.device_mesh, param.placements, tuple(param.shape)
    if any(getattr(p, "dim", 0) > 1 for p in placements):
        raise ValueError(f"seeded init splits only dims 0 and 1, not {placements}")
    n_rows, n_cols = shape[0], param.numel() // shape[0]
    # Along the dimension not asked for, one element per shard: each rank keeps one.
    across = [math.prod(mesh.size(i) for i, p in enumerate(placements) if getattr(p, "dim", None) == d)
              for d in (0, 1)]
    rows = compat.distribute_local(torch.arange(n_rows)[:, None].expand(n_rows, across[1]), mesh, placements)
    cols = compat.distribute_local(torch.arange(n_cols)[None, :].expand(across[0], n_cols), mesh, placements)
    return rows.to_local()[:, 0].cpu(), cols.to_local()[0].cpu()


def clip_grad_norm(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """`clip_grad_norm_` over the whole model: a DTensor norm (FSDP/TP) made whole over its mesh, and with
    PP the squares summed over the pp ranks, which hold different parameters (as torchtitan does)."""
    import torch.distributed as dist

    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if pp_group is not None:
        norm = norm ** 2
        dist.all_reduce(norm, group=pp_group)
        norm = norm ** 0.5
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
