"""The LM head and its cross-entropy: in one piece, or in slices of the sequence that each backpropagate at once.

`head_loss` is what `Llama.forward` calls with targets. In one piece it is `cross_entropy_sum(head(h))`,
compiled with its backward when the trainer compiles (inductor fuses the fp32 upcast into the log-softmax
instead of writing an fp32 copy of the B·T·V logits). In `chunks` slices (`train.loss_chunks`), each slice's
logits exist only while that slice's loss and gradients are computed, in forward: one head matmul per slice
and the two of its backward, as in one piece, never a recompute (torchtitan's ChunkedLossWrapper does the
same with a backward per chunk; here the gradients are kept and scaled by the loss's incoming gradient, so the
caller may divide the sum by anything it likes, as the trainer does).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100   # chat data's untrained positions, as cross_entropy's default ignore_index


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy over the targets that are not -100 (chat data's untrained positions), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return cross_entropy_sum(F.linear(h, weight), targets)


def slice_loss_and_grads(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, need_w: bool):
    """One slice (N, D) of the head input: Σ CE of (h @ weight.T) and the gradients of that sum w.r.t. h and
    the weight, written out (what autograd would do) so that it compiles as one graph with no autograd in it.
    The matmuls run in weight's dtype (the compute dtype); the log-softmax, the loss and the gradient of the
    logits are fp32, the latter cast back for the two matmuls as autograd casts it through the upcast."""
    h = h.to(weight.dtype)
    logits = h @ weight.t()
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = targets != IGNORE
    idx = torch.where(valid, targets, 0)[:, None]
    loss = torch.where(valid, lse - lf.gather(1, idx).squeeze(1), 0.0).sum()
    g = (lf - lse[:, None]).exp().scatter_add(1, idx, torch.full_like(idx, -1, dtype=lf.dtype))
    g = (g * valid[:, None]).to(logits.dtype)
    return loss, g @ weight, (g.t() @ h if need_w else None)


@functools.cache
def _compiled(fn):
    # One compiled wrapper per function for the process (the model keeps only a flag: it stays copyable).
    return torch.compile(fn)


class _SlicedHeadLoss(torch.autograd.Function):
    """Σ CE of (h @ weight.T) over `chunks` slices of the B·T rows, each slice's gradients computed in forward
    and only scaled by the incoming gradient in backward: the peak holds one slice's logits, not B·T·V."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunks, compute_dtype, compiled):
        kernel = _compiled(slice_loss_and_grads) if compiled else slice_loss_and_grads
        need_w = ctx.needs_input_grad[1]
        ctx.weight_dtype = weight.dtype
        w = weight.to(compute_dtype)
        rows, y = h.flatten(0, 1), targets.flatten()
        grad_h = torch.empty_like(rows)
        # summed over slices in fp32: each slice's weight gradient in the compute dtype rounds on its own
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        total = h.new_zeros((), dtype=torch.float32)
        n = rows.shape[0]
        bounds = sorted({n * i // chunks for i in range(chunks + 1)})
        for start, stop in zip(bounds, bounds[1:]):
            loss, gh, gw = kernel(rows[start:stop], w, y[start:stop], need_w)
            total += loss
            grad_h[start:stop] = gh
            if need_w:
                grad_w += gw
        ctx.save_for_backward(grad_h.view_as(h), grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.weight_dtype)
        return grad_h * grad_out.to(grad_h.dtype), gw, None, None, None, None


def _plain_head(head: nn.Module) -> bool:
    """A bias-free nn.Linear holding a plain tensor: the sliced path reads its weight directly. Anything else
    (LoRA, float8, a TP DTensor weight, hooks) goes through the module itself."""
    return (type(head) is nn.Linear and head.bias is None and type(head.weight) in (torch.Tensor, nn.Parameter)
            and not head._forward_hooks and not head._forward_pre_hooks)


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in here: autocast's when it is on for h's device, else h's own."""
    kind = h.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else h.dtype


def head_loss(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunks: int = 1,
              compiled: bool = False) -> torch.Tensor:
    """Σ cross-entropy (fp32) of head(h) against targets that are not -100, in `chunks` slices of B·T."""
    plain = _plain_head(head)
    if chunks <= 1:
        if plain and compiled:
            return _compiled(linear_cross_entropy_sum)(h, head.weight, targets)
        return cross_entropy_sum(head(h), targets)
    if not torch.is_grad_enabled() or not (h.requires_grad or head.weight.requires_grad):
        # evaluation: no gradients to keep, so slices of the plain loss
        return sum(cross_entropy_sum(head(h_c), y_c)
                   for h_c, y_c in zip(h.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)))
    if plain:
        dtype = compute_dtype(h)
        with torch.autocast(h.device.type, enabled=False):   # the dtypes are chosen above, explicitly
            return _SlicedHeadLoss.apply(h, head.weight, targets, chunks, dtype, compiled)
    return _checkpointed_slices(head, h, targets, chunks)


def _checkpointed_slices(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """Slices whose logits are recomputed in backward (activation checkpointing): for heads the sliced path
    cannot read (TP's DTensor weight, LoRA), at one more head matmul per slice."""
    from torch.utils.checkpoint import checkpoint

    def piece(h_c: torch.Tensor, y_c: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(head(h_c), y_c)

    total = h.new_zeros((), dtype=torch.float32)
    for h_c, y_c in zip(h.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        total = total + checkpoint(piece, h_c, y_c, use_reentrant=False)
    return total
