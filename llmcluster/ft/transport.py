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
A sharded (DTensor) value travels as its local shard: the same rank of the peer group holds the same shard.
"""

from __future__ import annotations

import contextlib
import json
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
from torch.distributed.tensor import DTensor
from torchft.checkpointing import CheckpointTransport

from llmcluster.ft import seal
from llmcluster.launch.ft_auth import RunKey, shown
from llmcluster.testing import test_hook

MAC_HEADER = "X-Llmcluster-Mac"
# Test hook (LLMCLUSTER_TESTING=1): "extra-key" makes this process's first heal payload carry a key the model lacks
BAD_HEAL_ENV = "LLMCLUSTER_TEST_FT_BAD_HEAL"
_SCALARS = (type(None), bool, int, float, str)
_SLACK_BYTES = 64 << 20   # a payload may exceed the template's tensors by this much (JSON, optimizer state)


class HealRefused(Exception):
    """A heal payload or its source that the group will not load; the message is one line."""


class _Quiet(logging.Filter):
    """torchft logs a recovery's exception with its traceback; a refusal is said in one line by ft/group.py."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HealRefused))


logging.getLogger("torchft.manager").addFilter(_Quiet())


# -- the payload: a JSON head (the tree, each tensor's dtype and shape), then each tensor's bytes -------------------
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def payload_chunks(state):
    """The plaintext chunks of `state`: the head, then every tensor's bytes in pieces of at most CHUNK_BYTES. A
    tensor is copied to the CPU only when its turn comes (the sender holds one tensor, never the whole payload)."""
    tensors: list[torch.Tensor] = []

    def walk(v):
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            if str(v.dtype).removeprefix("torch.") not in _DTYPES:
                raise TypeError(f"a heal payload holds a {v.dtype} tensor")
            tensors.append(v)
            return {"T": len(tensors) - 1}
        if isinstance(v, dict):
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in v):
                raise TypeError(f"a heal payload holds a dict key that is not a str or int: {list(v)[:3]}")
            return {"d": [[k, walk(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            return {"l": [walk(x) for x in v]}
        if isinstance(v, _SCALARS):
            return v
        raise TypeError(f"a heal payload holds a {type(v).__name__}: only tensors, dicts, lists and JSON scalars")

    tree = walk(state)
    head = json.dumps({"tree": tree, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                 for t in tensors]}).encode()
    yield len(head).to_bytes(8, "big")
    for raw in [memoryview(head)] + tensors:
        if isinstance(raw, torch.Tensor):
            raw = memoryview(raw.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        for off in range(0, len(raw), seal.CHUNK_BYTES):
            yield raw[off:off + seal.CHUNK_BYTES]


def _read_into(next_chunk, flat: torch.Tensor) -> None:
    """`flat` (uint8, any device) filled from the next chunks, each copied as it arrives."""
    off = 0
    while off < flat.numel():
        data = next_chunk(min(seal.CHUNK_BYTES, flat.numel() - off))
        if not data:
            raise HealRefused("the payload ends inside a tensor")
        flat[off:off + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        off += len(data)


def receive(next_chunk, template: dict, params: list, limit: int):
    """The state read from `next_chunk(n)` (the next plaintext chunk, at most n bytes): the head is checked against
    this group's state (checked) before any tensor's bytes are read, then each chunk is copied into the tensor the
    check placed for it, on this group's device."""
    try:
        size = int.from_bytes(next_chunk(8), "big")
        if size > _SLACK_BYTES:
            raise HealRefused(f"the payload's head claims {size} bytes: over {_SLACK_BYTES}")
        raw = torch.empty(size, dtype=torch.uint8)
        _read_into(next_chunk, raw)
        head = json.loads(raw.numpy().tobytes())
        tree, specs = head["tree"], head["tensors"]
        holes = [torch.empty([int(n) for n in shape], dtype=_DTYPES[dtype], device="meta") for dtype, shape in specs]
    except HealRefused:
        raise
    except Exception as e:   # noqa: BLE001 - any malformed payload is one refusal
        raise HealRefused(f"the payload is not a heal payload ({type(e).__name__})") from None
    if sum(h.numel() * h.element_size() for h in holes) > limit:
        raise HealRefused(f"the payload holds over {limit} bytes of tensors: more than this group's state")
    used: set[int] = set()

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"T"} and isinstance(v["T"], int) and 0 <= v["T"] < len(holes) and v["T"] not in used:
                used.add(v["T"])   # each tensor once: one the check did not place would stay uninitialised
                return holes[v["T"]]
            if set(v) == {"d"} and isinstance(v["d"], list):
                if not all(isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (str, int)) for kv in v["d"]):
                    raise HealRefused("the payload holds a malformed dict")
                return {k: walk(x) for k, x in v["d"]}
            if set(v) == {"l"} and isinstance(v["l"], list):
                return [walk(x) for x in v["l"]]
            raise HealRefused("the payload holds an object that is not a tensor, dict, list or JSON scalar")
        if isinstance(v, _SCALARS):
            return v
        raise HealRefused("the payload holds a malformed value")
    out = checked(walk(tree), template, params)
    if len(used) != len(holes) or not all(hasattr(h, "_heal_into") for h in holes):
        raise HealRefused("the payload holds tensors its tree does not place")
    for h in holes:
        _read_into(next_chunk, h._heal_into.reshape(-1).view(torch.uint8))
    return out


def _placed(got: torch.Tensor, device) -> torch.Tensor:
    """A payload's tensor on `device`: a hole (its bytes not read yet) gets the tensor they will be copied into."""
    if not got.is_meta:
        return got.to(device)
    got._heal_into = torch.empty(got.shape, dtype=got.dtype, device=device)
    return got._heal_into


# -- the check against the receiver's own state -------------------------------------------------------------------
def _same_tensor(got, want, where: str):
    """`got` (plain, from the payload) shaped as `want`; a DTensor `want` gets `got` as its local shard."""
    if not isinstance(got, torch.Tensor):
        raise HealRefused(f"{where}: a {type(got).__name__} where a tensor belongs")
    local = want.to_local() if isinstance(want, DTensor) else want
    if tuple(got.shape) != tuple(local.shape) or got.dtype != local.dtype:
        raise HealRefused(f"{where}: shape {tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}, this group's "
                          f"is {tuple(local.shape)} {str(local.dtype).removeprefix('torch.')}")
    got = _placed(got, local.device)
    if isinstance(want, DTensor):
        return DTensor.from_local(got, want.device_mesh, want.placements, shape=want.shape, stride=want.stride(),
                                  run_check=False)
    return got


def _same_tree(got, want, where: str):
    """`got` checked key by key and type by type against `want` (this group's own value at `where`)."""
    if isinstance(want, torch.Tensor):
        return _same_tensor(got, want, where)
    if isinstance(want, dict):
        if not isinstance(got, dict):
            raise HealRefused(f"{where}: a {type(got).__name__} where a dict belongs")
        if set(got) != set(want):
            extra, missing = sorted(map(str, set(got) - set(want))), sorted(map(str, set(want) - set(got)))
            raise HealRefused(f"{where}: keys differ (extra {extra[:3]}, missing {missing[:3]})")
        return {k: _same_tree(got[k], want[k], f"{where}.{k}") for k in want}
    if isinstance(want, (list, tuple)):   # lengths may differ (a window of recent losses): elements by type
        if not isinstance(got, list):
            raise HealRefused(f"{where}: a {type(got).__name__} where a list belongs")
        proto = want[0] if len(want) else None
        out = [_same_tree(x, proto, f"{where}[{i}]") if proto is not None else _scalar(x, f"{where}[{i}]")
               for i, x in enumerate(got)]
        return type(want)(out) if isinstance(want, tuple) else out
    if want is None:   # unset on this side (e.g. no scaler): anything but a tensor or an object
        return _plain(got, where)
    if isinstance(want, bool) or not isinstance(want, (int, float)):
        if type(got) is not type(want):
            raise HealRefused(f"{where}: a {type(got).__name__} where a {type(want).__name__} belongs")
        return got
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise HealRefused(f"{where}: a {type(got).__name__} where a number belongs")
    return type(want)(got) if isinstance(want, float) else got


def _scalar(v, where: str):
    if not isinstance(v, _SCALARS):
        raise HealRefused(f"{where}: a {type(v).__name__} where a plain value belongs")
    return v


def _plain(v, where: str):
    if isinstance(v, torch.Tensor):
        raise HealRefused(f"{where}: a tensor where none belongs")
    if isinstance(v, dict):
        return {k: _plain(x, f"{where}.{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return _scalar(v, where)


def _same_optimizer(got, want: dict, params: list, where: str) -> dict:
    """An optimizer state_dict: param_groups as this group's; per parameter index, each state tensor shaped as that
    parameter or a scalar (a fresh optimizer has no state yet to compare with)."""
    if not isinstance(got, dict) or set(got) != {"state", "param_groups"}:
        raise HealRefused(f"{where}: not an optimizer state (keys state, param_groups)")
    if not isinstance(got["param_groups"], list) or len(got["param_groups"]) != len(want["param_groups"]):
        raise HealRefused(f"{where}.param_groups: not this group's parameter groups")
    groups = [_same_tree(g, w, f"{where}.param_groups[{i}]")
              for i, (g, w) in enumerate(zip(got["param_groups"], want["param_groups"]))]
    for i, (g, w) in enumerate(zip(groups, want["param_groups"])):
        if g["params"] != w["params"]:
            raise HealRefused(f"{where}.param_groups[{i}].params: not this group's parameters")
    state = got["state"]
    if not isinstance(state, dict) or not set(state) <= set(range(len(params))):
        raise HealRefused(f"{where}.state: keys that are not this group's parameter indices")
    out = {}
    for i, entry in state.items():
        if i in want["state"]:
            out[i] = _same_tree(entry, want["state"][i], f"{where}.state[{i}]")
            continue
        if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
            raise HealRefused(f"{where}.state[{i}]: not a parameter's state")
        out[i] = {}
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == torch.float32:
                out[i][k] = _placed(v, "cpu")
            else:
                out[i][k] = _same_tensor(v, params[i], f"{where}.state[{i}].{k}")
    return {"state": out, "param_groups": groups}


def checked(payload, template: dict, params: list) -> dict:
    """torchft's state ({"user": {"default": ours}, "torchft": {...}}) checked against `template` (ours, as
    Replica builds it) and rebuilt on our devices and meshes; HealRefused otherwise."""
    if not isinstance(payload, dict) or set(payload) != {"user", "torchft"}:
        raise HealRefused("the payload is not a torchft state (keys user, torchft)")
    tf = _same_tree(payload["torchft"], {"step": 0, "batches_committed": 0}, "torchft")
    user = payload["user"]
    if not isinstance(user, dict) or set(user) != {"default"}:
        raise HealRefused("the payload's user state is not one default state")
    got, out = user["default"], {}
    if not isinstance(got, dict) or set(got) != set(template):
        raise HealRefused(f"state: keys differ from this group's ({sorted(map(str, got))[:6] if isinstance(got, dict) else type(got).__name__})")
    for k, want in template.items():
        out[k] = (_same_optimizer(got[k], want, params, k) if k == "optimizer" else _same_tree(got[k], want, k))
    return {"user": {"default": out}, "torchft": tf}


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
                with transport._lock:   # proved: a heal may take ft.timeout_s per socket operation
                    transport._unproved.pop(self.connection, None)
                self.connection.settimeout(transport.timeout.total_seconds())
                try:
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
            yield sealer.seal(chunk)
        yield sealer.seal(b"", last=True)

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
        limit = tensor_bytes(template) * 2 + _SLACK_BYTES   # the optimizer's state may not exist here yet
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


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if isinstance(obj, DTensor) else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
