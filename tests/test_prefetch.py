"""The batch prefetcher (data/prefetch.py): a background thread gathers whole steps ahead, yet the batches
are bit for bit the sampler's own, in its order; contiguous; the position a checkpoint saves is the last
step handed out, not how far the thread got; and the thread ends on close, on an exception in the training
loop and on one in the thread itself (no hung thread)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from llmcluster.data.dataset import MixtureSampler, Sampler, open_dataset
from llmcluster.data.prefetch import Prefetcher

ARGS = [(8, 0, 1, 4), (8, 1, 2, 2)]  # (global batch, dp rank, dp size, micro-batch): accum 2 both


def _samplers(tiny_root, mixture: bool):
    ds = open_dataset(tiny_root, "tiny", verify=False)
    if mixture:  # two sources over the same data: exercises the mixture's per-source state
        return [MixtureSampler([("a", ds, 3.0), ("b", ds, 1.0)], 32, seed=1) for _ in range(2)]
    return [Sampler(ds, 32, seed=1) for _ in range(2)]


def _same(a, b) -> bool:
    return all(np.array_equal(ia, ib) and torch.equal(xa, xb) and torch.equal(ya, yb)
               for (ia, xa, ya), (ib, xb, yb) in zip(a, b, strict=True))


def _no_prefetch_thread() -> bool:
    return not any(t.name == "llmcluster-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("args", ARGS)
@pytest.mark.parametrize("mixture", [False, True])
def test_batches_bitwise_and_in_order_and_the_position_is_the_last_step_handed_out(tiny_root, mixture, args):
    plain, inner = _samplers(tiny_root, mixture)
    with Prefetcher(inner, depth=2) as pre:
        for step in range(5):
            want = list(plain.micro_batches(*args))
            got = list(pre.micro_batches(*args))
            assert _same(want, got), step
            assert all(x.is_contiguous() and y.is_contiguous() for _, x, y in got)
            assert not pre.pin  # no CUDA here: pinned only where the copy to a GPU can use it
            # the thread has drawn ahead, but what a checkpoint saves is where training is
            assert pre.state_dict() == plain.state_dict() and pre.consumed == plain.consumed
            assert pre.tokens_by_source() == plain.tokens_by_source()
        # it does prefetch: the thread draws ahead of the last step handed out (waited for: a loaded machine
        # may not have scheduled it yet)
        deadline = time.monotonic() + 60
        while inner.consumed <= plain.consumed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inner.consumed > plain.consumed
        state = pre.state_dict()
    assert _no_prefetch_thread()

    # resume from the saved position: the same continuation as the sampler that never stopped
    _, fresh = _samplers(tiny_root, mixture)
    with Prefetcher(fresh) as resumed:
        resumed.load_state_dict(state)
        for step in range(3):
            assert _same(list(plain.micro_batches(*args)), list(resumed.micro_batches(*args))), step
    assert _no_prefetch_thread()


def test_the_thread_ends_when_the_training_loop_raises(tiny_root):
    _, inner = _samplers(tiny_root, False)
    with pytest.raises(ZeroDivisionError):
        with Prefetcher(inner, depth=1) as pre:
            next(pre.micro_batches(*ARGS[0]))
            1 / 0  # the queue is full and the thread waits to put the next step: close must still end it
    assert _no_prefetch_thread()


def test_an_error_in_the_thread_reaches_the_training_loop(tiny_root):
    _, inner = _samplers(tiny_root, False)

    def broken(*_):
        raise OSError(5, "Input/output error (a lost shard)")
        yield  # pragma: no cover

    inner.micro_batches = broken
    with Prefetcher(inner) as pre:
        with pytest.raises(OSError, match="lost shard"):
            pre.micro_batches(*ARGS[0])
    assert _no_prefetch_thread()
