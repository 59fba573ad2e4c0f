"""The heal of an ft group carries data, from a peer that proves it holds the run's secret (issue 49).

torchft's default transport serves a group's whole state over plain HTTP on every interface and loads a peer's with
`torch.load(weights_only=False)`: whoever answers as the source of a heal runs code in the healing group, and
whoever asks copies the model. This transport (torchft's CheckpointTransport interface, given to the Manager) does
instead:

  * the heal address torchft publishes (metadata()) carries the source's group and step and a MAC over them and the
    address; the healer refuses, in one line, an address its peer did not sign (a stranger's `quorum` call plants
    addresses in a ManagerServer), before connecting (issue 63);
  * the server binds the group's own address (the interface that reaches the Lighthouse: 127.0.0.1 for a local
    run) and answers `GET /heal/<step>?nonce=N` only with `X-Llmcluster-Mac: MAC(req, host:port, step, N)`
    (launch/ft_auth.py), naming its own host:port (a request sent to a relay names the relay), each nonce once;
    it serves at most C connections at once, and closes one whose request has not proved the secret after T s;
  * the payload is a JSON head (a tree of dicts, lists, numbers, strings; each tensor's dtype and shape) and each
    tensor's bytes, sealed in chunks keyed from the secret and the nonce (ft/seal.py) and streamed: the sender
    copies one tensor at a time off the device, the receiver copies each chunk into place;
  * the receiver checks the head against its own state before any tensor's bytes are read: the model's names,
    shapes and dtypes exactly, the optimizer's state per parameter (shape and dtype of that parameter, or a
    scalar), and every other key and type. A payload that fails is refused in one line (`refused`): the group
    stops and its launcher starts it again (ft/group.py).
The payload and its checks: ft/payload.py; the seal: ft/seal.py.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch
from torchft.checkpointing import CheckpointTransport

from llmcluster.ft import seal
# tensor_bytes: ft/group.py reads it from here
from llmcluster.ft.payload import SLACK_BYTES, HealRefused, payload_chunks, receive, tensor_bytes
from llmcluster.launch.ft_auth import RunKey, shown
from llmcluster.testing import test_hook

MAC_HEADER = "X-Llmcluster-Mac"
# Test hook (LLMCLUSTER_TESTING=1): "extra-key" makes this process's first heal payload carry a key the model lacks
BAD_HEAL_ENV = "LLMCLUSTER_TEST_FT_BAD_HEAL"


class _Quiet(logging.Filter):
    """torchft logs a recovery's exception with its traceback; a refusal is said in one line by ft/group.py."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))


logging.getLogger("torchft.manager").addFilter(_Quiet())


# -- the transport --------------------------------------------------------------------------------------------
HEAL_CONNECTIONS = 16   # C: connections a heal server serves at once (more are closed at once: torchft retries)
HEAL_IDLE_S = 10.0      # T: the most a connection lives before its request proves the secret


class SignedTransport(CheckpointTransport):
    """`template()`: this group's own state (names, shapes, dtypes, meshes) and `params()`: its parameters in the
    optimizer's order, both read when a payload arrives. `log`: one line per refused request or payload.
    `connections` and `idle_s`: C and T above (smaller in tests)."""

    def __init__(self, key: RunKey, address: str, timeout: timedelta, template, params, log=print,
                 connections: int = HEAL_CONNECTIONS, idle_s: float = HEAL_IDLE_S):
        self.key, self.timeout, self.template, self.params, self.log = key, timeout, template, params, log
        self.refused: str | None = None       # the last payload refused (ft/group.py stops the group on it)
        self.source, self.step = "", lambda: 0   # what metadata() signs beside the address (ft/group.py sets them)
        self._lock = threading.Condition()
        self._staged: tuple[int, dict] | None = None   # (step, state): encoded as each request streams it
        self._readers = 0
        self._nonces: set[str] = set()
        self._unproved: dict = {}   # connection -> its deadline (monotonic), until its request proves the secret
        self._spoiled = False
        self.open_connections = 0   # handler threads alive now (tests: at most C)
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = idle_s   # each socket operation before the proof; a half-open client is closed after T

            def setup(self):
                super().setup()
                # and the whole request head, however slowly it drips in (a socket timeout is per read): the
                # reaper hangs up at the deadline (one thread for all connections, not one timer each)
                with transport._lock:
                    transport._unproved[self.connection] = time.monotonic() + idle_s

            def finish(self):
                with transport._lock:
                    transport._unproved.pop(self.connection, None)
                super().finish()

            def log_message(self, *_a):   # no line per request on the rank's stderr
                pass

            def _plain(self, code: int, body: bytes = b""):
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self):   # any other method: no state, no proof asked
                self._plain(403)

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

            def do_GET(self):
                code, answer = transport._answer(self.path, self.headers.get(MAC_HEADER, ""))
                if code != 200:
                    return self._plain(code, answer)
                try:
                    with transport._lock:   # proved: a heal may take ft.timeout_s per socket operation
                        transport._unproved.pop(self.connection, None)
                    self.connection.settimeout(transport.timeout.total_seconds())
                    self.send_response(200)   # no length: HTTP/1.0, the stream ends when the connection closes
                    self.end_headers()
                    for frame in answer:
                        self.wfile.write(frame)
                finally:   # however the stream ends: disallow_checkpoint waits for it
                    with transport._lock:
                        transport._readers -= 1
                        transport._lock.notify_all()

        class Server(ThreadingHTTPServer):
            address_family, daemon_threads = _family(address.strip("[]")), True
            slots = threading.BoundedSemaphore(connections)
            request_queue_size = 64   # socketserver's 5 makes a burst of connects wait for SYN retries (1 s, 3 s...)

            def process_request(self, request, client_address):
                if not self.slots.acquire(blocking=False):   # C busy: closed, no thread
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address):
                with transport._lock:
                    transport.open_connections += 1
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    with transport._lock:
                        transport.open_connections -= 1
                    self.slots.release()

        host = address.strip("[]")
        self._server = Server((host, 0), Handler)
        self._url_host = f"[{host}]" if ":" in host else host
        self.dest = f"{self._url_host}:{self._server.server_address[1]}"   # what a request's MAC must name
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="ft-heal-server")
        self._thread.start()
        self._stopped = threading.Event()
        threading.Thread(target=self._reap, args=(min(0.25, idle_s / 4),), daemon=True, name="ft-heal-reaper").start()

    def _reap(self, every: float) -> None:
        """Hangs up each connection whose request has not proved the secret by its deadline (T)."""
        while not self._stopped.wait(every):
            now = time.monotonic()
            with self._lock:
                late = [c for c, deadline in self._unproved.items() if deadline <= now]
                for c in late:
                    del self._unproved[c]
            for c in late:
                _hang_up(c)

    def _answer(self, path: str, mac: str):
        """(code, body) or (200, the sealed frames of the staged state)."""
        u = urlsplit(path)
        parts = u.path.split("/")
        nonce = parse_qs(u.query).get("nonce", [""])[0]
        if len(parts) != 3 or parts[1] != "heal" or not parts[2].isdigit() or len(nonce) != 32 \
                or not all(c in "0123456789abcdef" for c in nonce):
            return 400, b"bad request\n"
        step = int(parts[2])
        with self._lock:
            # the destination is in the proof: a request a relay forwards here names the relay, not this server
            if not self.key.verify(mac, "req", self.dest, step, nonce) or nonce in self._nonces:
                self.log(f"ft: refused a heal request for step {step}: it does not carry this run's proof for "
                         f"this server ({self.dest})")
                return 403, b"forbidden\n"
            self._nonces.add(nonce)
            # the receiver may ask before this side has staged the step (both leave the same quorum at once)
            self._lock.wait_for(lambda: self._staged is not None and self._staged[0] >= step, self.timeout.total_seconds())
            staged = self._staged
            if staged is None or staged[0] != step:
                return 409, b"not serving that step\n"
            self._readers += 1
        return 200, self._frames(staged[1], seal.heal_key(self.key, nonce, step, self.dest))

    @staticmethod
    def _frames(state, aead):
        sealer = seal.Sealer(aead)
        for chunk in payload_chunks(state):
            yield from sealer.frame(chunk)
        yield from sealer.frame(b"", last=True)

    def metadata(self) -> str:
        """The heal address torchft publishes, signed: a stranger's `quorum` call can plant another address in our
        ManagerServer, never one the healer accepts."""
        base, step = f"http://{self.dest}/heal/", self.step()
        return f"{base}?src={self.source}&step={step}&mac={self.key.mac('src', base, self.source, step)}"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        if not self._spoiled and test_hook(BAD_HEAL_ENV) == "extra-key":   # the first payload only
            self._spoiled = True
            state_dict["user"]["default"]["model"] = {**state_dict["user"]["default"]["model"],
                                                      "planted.weight": torch.zeros(1)}
        with self._lock:
            self._staged = (step, state_dict)   # torchft changes no tensor of it before disallow_checkpoint
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:   # a stream in progress reads the live tensors: the optimizer steps after it ends
            self._staged = None
            self._lock.wait_for(lambda: self._readers == 0, self.timeout.total_seconds())

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        try:
            return self._recv(metadata, step, timeout)
        except HealRefused as e:
            self.refused = str(e)
            raise

    def source_of(self, metadata: str, step: int) -> tuple[str, str]:
        """(the heal server's base URL, its host:port) from a heal address its group signed; HealRefused naming what
        failed, ConnectionError for a signed address of another step (the source moved on: torchft retries)."""
        u = urlsplit(metadata)
        q = parse_qs(u.query)
        src, signed, mac = (q.get(k, [""])[0] for k in ("src", "step", "mac"))
        if u.scheme != "http" or not u.hostname or u.path != "/heal/" or u.fragment or not signed.isdigit():
            raise HealRefused(f"the source's address is not a heal server's ({shown(metadata)})")
        base = f"http://{u.netloc}/heal/"
        if not self.key.verify(mac, "src", base, src, int(signed)):
            raise HealRefused(f"the source's heal address {shown(base)} is not signed with this run's secret "
                              "(planted in torchft's checkpoint_metadata)")
        if int(signed) != step:
            raise ConnectionError(f"the source's heal address was signed at step {signed}, the heal is for {step}")
        return base, u.netloc

    def _recv(self, metadata: str, step: int, timeout: timedelta):
        base, dest = self.source_of(metadata, step)
        nonce = secrets.token_hex(16)
        req = urllib.request.Request(f"{base}{step}?nonce={nonce}",
                                     headers={MAC_HEADER: self.key.mac("req", dest, step, nonce)})
        template = self.template()
        limit = tensor_bytes(template) * 2 + SLACK_BYTES   # the optimizer's state may not exist here yet
        try:
            r = urllib.request.urlopen(req, timeout=timeout.total_seconds())
        except (urllib.error.URLError, OSError) as e:   # not a refusal: torchft fails the step, the heal is retried
            raise ConnectionError(f"the heal source did not serve step {step}: {getattr(e, 'reason', None) or e}") \
                from None
        with r:
            opener = seal.Opener(seal.heal_key(self.key, nonce, step, dest), r.read)

            def next_chunk(n: int) -> bytes:
                try:
                    plain, last = opener.open(n)
                except seal.SealBroken as e:
                    raise HealRefused(f"the payload does not carry this run's proof: {e}") from None
                except OSError as e:
                    raise ConnectionError(f"the heal of step {step} broke off: {e}") from None
                if last:
                    raise HealRefused("the payload ends before its tensors do (cut short)")
                return plain

            out = receive(next_chunk, template, self.params(), limit)
            try:
                opener.close()
            except seal.SealBroken as e:
                raise HealRefused(f"the payload does not carry this run's proof: {e}") from None
        return out

    def shutdown(self, wait: bool = True) -> None:
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()


def _hang_up(sock) -> None:
    import socket

    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _family(host: str):
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET
