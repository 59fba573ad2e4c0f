"""The heal of an ft group carries data, from a peer that proves it holds the run's secret (issue 49).

torchft's default transport serves a group's whole state over plain HTTP on every interface and loads a peer's with
`torch.load(weights_only=False)`: whoever answers as the source of a heal runs code in the healing group, and
whoever asks copies the model. This transport (torchft's CheckpointTransport interface, given to the Manager) does
instead:

  * the server binds the group's own address (the interface that reaches the Lighthouse: 127.0.0.1 for a local
    run) and answers `GET /heal/<step>?nonce=N` only with `X-Llmcluster-Mac: MAC(req, step, N)` (launch/ft_auth.py),
    each nonce once;
  * the payload is a JSON tree (dicts, lists, numbers, strings) whose tensors are entries of one safetensors blob,
    sent with `X-Llmcluster-Mac: MAC(resp, step, N, sha256(body))`;
  * the receiver checks the MAC, then the tree against its own state before anything is copied: the model's names,
    shapes and dtypes exactly, the optimizer's state per parameter (shape and dtype of that parameter, or a scalar),
    and every other key and type. A payload that fails is refused in one line (`refused`): the group stops and its
    launcher starts it again (ft/group.py).
A sharded (DTensor) value travels as its local shard: the same rank of the peer group holds the same shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import torch
from safetensors.torch import load as st_load, save as st_save
from torch.distributed.tensor import DTensor
from torchft.checkpointing import CheckpointTransport

from llmcluster.launch.ft_auth import RunKey
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


# -- the payload: a JSON tree + one safetensors blob ------------------------------------------------------------
def encode(state) -> bytes:
    tensors: dict[str, torch.Tensor] = {}

    def walk(v):
        if isinstance(v, DTensor):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = v.detach().cpu().contiguous()
            return {"T": name}
        if isinstance(v, dict):
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in v):
                raise TypeError(f"a heal payload holds a dict key that is not a str or int: {list(v)[:3]}")
            return {"d": [[k, walk(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            return {"l": [walk(x) for x in v]}
        if isinstance(v, _SCALARS):
            return v
        raise TypeError(f"a heal payload holds a {type(v).__name__}: only tensors, dicts, lists and JSON scalars")

    head = json.dumps(walk(state)).encode()
    return len(head).to_bytes(8, "big") + head + st_save(tensors)


def decode(body: bytes):
    """The tree with plain CPU tensors (safetensors: no code, no classes)."""
    try:
        n = int.from_bytes(body[:8], "big")
        tree = json.loads(body[8:8 + n])
        tensors = st_load(body[8 + n:])
    except Exception as e:   # noqa: BLE001 - any malformed payload is one refusal
        raise HealRefused(f"the payload is not a heal payload ({type(e).__name__})") from None

    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"T"} and v["T"] in tensors:
                return tensors[v["T"]]
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
    return walk(tree)


# -- the check against the receiver's own state -------------------------------------------------------------------
def _same_tensor(got, want, where: str):
    """`got` (plain, from the payload) shaped as `want`; a DTensor `want` gets `got` as its local shard."""
    if not isinstance(got, torch.Tensor):
        raise HealRefused(f"{where}: a {type(got).__name__} where a tensor belongs")
    local = want.to_local() if isinstance(want, DTensor) else want
    if tuple(got.shape) != tuple(local.shape) or got.dtype != local.dtype:
        raise HealRefused(f"{where}: shape {tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}, this group's "
                          f"is {tuple(local.shape)} {str(local.dtype).removeprefix('torch.')}")
    got = got.to(local.device)
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
                out[i][k] = v
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
class SignedTransport(CheckpointTransport):
    """`template()`: this group's own state (names, shapes, dtypes, meshes) and `params()`: its parameters in the
    optimizer's order, both read when a payload arrives. `log`: one line per refused request or payload."""

    def __init__(self, key: RunKey, address: str, timeout: timedelta, template, params, log=print):
        self.key, self.timeout, self.template, self.params, self.log = key, timeout, template, params, log
        self.refused: str | None = None       # the last payload refused (ft/group.py stops the group on it)
        self._lock = threading.Condition()
        self._staged: tuple[int, bytes, str] | None = None   # (step, body, its sha256)
        self._nonces: set[str] = set()
        self._spoiled = False
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a):   # no line per request on the rank's stderr
                pass

            def _refuse(self):   # any other method: no state, no proof asked
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

            def do_GET(self):
                code, body, mac = transport._answer(self.path, self.headers.get(MAC_HEADER, ""))
                self.send_response(code)
                if mac:
                    self.send_header(MAC_HEADER, mac)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        host = address.strip("[]")
        server_cls = type("Server", (ThreadingHTTPServer,), {"address_family": _family(host), "daemon_threads": True})
        self._server = server_cls((host, 0), Handler)
        self._server.timeout = timeout.total_seconds()
        self._url_host = f"[{host}]" if ":" in host else host
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="ft-heal-server")
        self._thread.start()

    def _answer(self, path: str, mac: str) -> tuple[int, bytes, str]:
        u = urlsplit(path)
        parts = u.path.split("/")
        nonce = parse_qs(u.query).get("nonce", [""])[0]
        if len(parts) != 3 or parts[1] != "heal" or not parts[2].isdigit() or len(nonce) != 32:
            return 400, b"bad request\n", ""
        step = int(parts[2])
        with self._lock:
            if not self.key.verify(mac, "req", step, nonce) or nonce in self._nonces:
                self.log(f"ft: refused a heal request for step {step}: it does not carry this run's proof")
                return 403, b"forbidden\n", ""
            self._nonces.add(nonce)
            # the receiver may ask before this side has staged the step (both leave the same quorum at once)
            self._lock.wait_for(lambda: self._staged is not None and self._staged[0] >= step, self.timeout.total_seconds())
            staged = self._staged
        if staged is None or staged[0] != step:
            return 409, b"not serving that step\n", ""
        return 200, staged[1], self.key.mac("resp", step, nonce, staged[2])

    def metadata(self) -> str:
        return f"http://{self._url_host}:{self._server.server_address[1]}/heal/"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        if not self._spoiled and test_hook(BAD_HEAL_ENV) == "extra-key":   # the first payload only
            self._spoiled = True
            state_dict["user"]["default"]["model"] = {**state_dict["user"]["default"]["model"],
                                                      "planted.weight": torch.zeros(1)}
        body = encode(state_dict)
        with self._lock:
            self._staged = (step, body, hashlib.sha256(body).hexdigest())
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        try:
            return self._recv(metadata, step, timeout)
        except HealRefused as e:
            self.refused = str(e)
            raise

    def _recv(self, metadata: str, step: int, timeout: timedelta):
        u = urlsplit(metadata)
        if u.scheme != "http" or not u.hostname or u.path != "/heal/" or u.query or u.fragment:
            raise HealRefused(f"the source's address is not a heal server's ({metadata[:80]!r})")
        nonce = secrets.token_hex(16)
        req = urllib.request.Request(f"{metadata}{step}?nonce={nonce}",
                                     headers={MAC_HEADER: self.key.mac("req", step, nonce)})
        template = self.template()
        limit = tensor_bytes(template) * 2 + _SLACK_BYTES   # the optimizer's state may not exist here yet
        try:
            with urllib.request.urlopen(req, timeout=timeout.total_seconds()) as r:
                body, mac = r.read(limit + 1), r.headers.get(MAC_HEADER, "")
        except (urllib.error.URLError, OSError) as e:   # not a refusal: torchft fails the step, the heal is retried
            raise ConnectionError(f"the heal source did not serve step {step}: {getattr(e, 'reason', None) or e}") \
                from None
        if len(body) > limit:
            raise HealRefused(f"the source sent over {limit} bytes: more than this group's state")
        if not self.key.verify(mac, "resp", step, nonce, hashlib.sha256(body).hexdigest()):
            raise HealRefused("the payload does not carry this run's proof (a stranger, or it was altered)")
        return checked(decode(body), template, self.params())

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()


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
