"""The training sampler's batches, gathered on a background thread a step or two ahead.

Without it the training thread gathers every micro-batch itself (memmap reads, the window permutation,
targets) while the GPU waits, and hands `.to(device, non_blocking=True)` a non-contiguous, pageable view,
which the copy first stages through a bounce buffer and which does not overlap with compute. Here a thread
draws whole steps from the sampler in its order, makes each tensor contiguous (and pinned where CUDA is
available, so the trainer's non_blocking copy is a real asynchronous DMA), and queues at most `depth` of them.

The sampler's position is what a checkpoint saves, and the thread runs ahead of training: the Prefetcher
answers `state_dict`, `consumed` and `tokens_by_source` as of the last step it handed out, so a checkpoint
resumes exactly where training stopped, never where the thread had got to.
"""

from __future__ import annotations

import queue
import threading

import torch


class Prefetcher:
    def __init__(self, sampler, depth: int = 2, pin: bool | None = None):
        self.sampler, self.depth = sampler, depth
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._thread: threading.Thread | None = None
        self._args: tuple | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._snapshot()

    # -- the sampler's interface, as of the last step handed out ------------------------------------
    def state_dict(self) -> dict:
        return self._state

    def tokens_by_source(self) -> dict[str, int]:
        return self._tokens

    @property
    def consumed(self) -> int:
        return self._consumed

    def load_state_dict(self, state: dict) -> None:
        if self._thread is not None:
            raise RuntimeError("Prefetcher.load_state_dict after batches were drawn")
        self.sampler.load_state_dict(state)
        self._snapshot()

    def micro_batches(self, global_batch: int, dp_rank: int, dp_size: int, micro_batch: int):
        """The next step's micro-batches, (sample_ids, x, y) as the sampler yields them."""
        args = (global_batch, dp_rank, dp_size, micro_batch)
        if self._thread is None:
            self._args = args
            self._thread = threading.Thread(target=self._run, name="llmcluster-prefetch", daemon=True)
            self._thread.start()
        elif args != self._args:
            raise RuntimeError(f"Prefetcher: batches asked for as {args}, drawn as {self._args}")
        item = self._next()
        if isinstance(item, BaseException):
            raise item
        batches, self._state, self._tokens, self._consumed = item
        return iter(batches)

    # -- lifetime ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the thread and wait for it (it never blocks for long: every wait has a short timeout)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                self._drain()
                self._thread.join(timeout=0.1)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------------------
    def _snapshot(self) -> None:
        s = self.sampler
        self._state, self._tokens, self._consumed = s.state_dict(), s.tokens_by_source(), s.consumed

    def _ready(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        return t.pin_memory() if self.pin else t

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                s = self.sampler
                batches = [(ids, self._ready(x), self._ready(y)) for ids, x, y in s.micro_batches(*self._args)]
                self._put((batches, s.state_dict(), s.tokens_by_source(), s.consumed))
        except BaseException as e:  # handed to the training thread, which raises it
            self._put(e)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _next(self):
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the batch prefetch thread stopped") from None

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
