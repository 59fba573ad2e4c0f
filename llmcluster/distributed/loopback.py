"""A local run's listeners on 127.0.0.1 only (issue 65; docs/security.md, "Listening sockets").

torch's TCPStore binds every interface whatever host it is given; only a listening socket handed to it
(`master_listen_fd=`) decides its address, and torch's default libuv store then listens there only. With
`LLMCLUSTER_LOOPBACK=1` in the environment, `install()` replaces `torch.distributed.TCPStore` by a subclass that
binds each server store's socket to 127.0.0.1 itself; every module that already holds the class by name (torch's
env:// rendezvous) gets the subclass too, and those imported later (torch's elastic rendezvous, torchft's
Manager) take it from torch.distributed. gloo's pairs are kept on loopback by GLOO_SOCKET_IFNAME=lo (LOOPBACK_ENV).

It must run before torchft is imported: the trainer's entry installs it first thing (llmcluster/__main__.py), the
local launcher runs torchrun's agent through this module (`python -m llmcluster.distributed.loopback ARGS` is
`python -m torch.distributed.run ARGS` with the store's listener on loopback).
"""

from __future__ import annotations

import os
import socket
import sys

from llmcluster.distributed import LOOPBACK_FLAG as ENV

# TCPStore's parameters in order (torch 2.13's pybind signature), for the positional callers
PARAMS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
          "master_listen_fd", "use_libuv")


def _listener(port: int) -> tuple[int, int]:
    """A socket bound to 127.0.0.1:`port` (0: the kernel picks), listening; its fd (handed over) and port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(socket.SOMAXCONN)
    port = s.getsockname()[1]
    return s.detach(), port


def install(environ=os.environ) -> bool:
    """Put the loopback TCPStore in place when `environ` asks for it; returns whether it did."""
    if environ.get(ENV) != "1":
        return False
    import torch.distributed as dist

    base = dist.TCPStore
    if getattr(base, "_llmcluster_loopback", False):
        return True

    class LoopbackTCPStore(base):
        _llmcluster_loopback = True

        def __init__(self, *args, **kwargs):
            kwargs.update(zip(PARAMS, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                kwargs["master_listen_fd"], kwargs["port"] = _listener(int(kwargs.get("port") or 0))
                # the server's own client: where it listens (a host name may resolve to another address)
                kwargs["host_name"] = "127.0.0.1"
            super().__init__(**kwargs)

    LoopbackTCPStore.__name__ = LoopbackTCPStore.__qualname__ = "TCPStore"
    for module in list(sys.modules.values()):    # the names bound before this ran (torch.distributed.rendezvous)
        if getattr(module, "TCPStore", None) is base:
            module.TCPStore = LoopbackTCPStore
    return True


if __name__ == "__main__":   # torchrun's agent, its rendezvous store on loopback
    import runpy

    os.environ[ENV] = "1"
    install()
    sys.argv[0] = "torch.distributed.run"
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
