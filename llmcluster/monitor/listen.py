"""Whether this host can listen on a port: the one check `monitor serve` and `serve start` share.

`serve start` on a port another server held reported that server as healthy while its own vLLM kept starting and
was recorded RUNNING (issue 64): the port is tried before anything is launched, and refused in the same line
`monitor serve` gives when its own bind fails.
"""

from __future__ import annotations

import socket

from llmcluster.errors import UserError


def cannot_listen(bind: str, port: int, e: OSError) -> UserError:
    return UserError(f"cannot listen on {bind}:{port}: {e.strerror or e}")


def check_can_listen(bind: str, port: int) -> None:
    """A one-line UserError when `bind:port` cannot be bound now (held by another process, or no such address).
    SO_REUSEADDR as servers set it: a port left in TIME_WAIT is free to them, a listening one is not."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((bind, port))
    except OSError as e:
        raise cannot_listen(bind, port, e) from None
