"""A heal payload as data (issues 49, 63): a JSON head, then each tensor's bytes, checked against the receiving
group's own state before any tensor's bytes are read (ft/transport.py carries it, sealed by ft/seal.py).

The head is a tree of dicts, lists and JSON scalars whose tensors are indices into its list of (dtype, shape): no
pickle, no class names. `receive` checks the tree (checked: the model's names, shapes and dtypes exactly, the
optimizer's state per parameter, every other key and type), allocates each tensor on this group's device where the
check places it, then copies the bytes in chunk by chunk: no copy of the whole payload on the host.
A sharded (DTensor) value travels as its local shard: the same rank of the peer group holds the same shard.
"""

from __future__ import annotations

import json
import warnings

import torch
from torch.distributed.tensor import DTensor

from llmcluster.ft import seal

_SCALARS = (type(None), bool, int, float, str)
SLACK_BYTES = 64 << 20   # a payload may exceed the template's tensors by this much (JSON, optimizer state)


class HealRefused(Exception):
    """A heal payload or its source that the group will not load; the message is one line."""


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
        with warnings.catch_warnings():   # read-only: only copied from, and not copied into a bytearray first
            warnings.simplefilter("ignore", UserWarning)
            chunk = torch.frombuffer(data, dtype=torch.uint8)
        flat[off:off + len(data)].copy_(chunk)
        off += len(data)


def receive(next_chunk, template: dict, params: list, limit: int):
    """The state read from `next_chunk(n)` (the next plaintext chunk, at most n bytes): the head is checked against
    this group's state (checked) before any tensor's bytes are read, then each chunk is copied into the tensor the
    check placed for it, on this group's device."""
    try:
        size = int.from_bytes(next_chunk(8), "big")
        if size > SLACK_BYTES:
            raise HealRefused(f"the payload's head claims {size} bytes: over {SLACK_BYTES}")
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


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if isinstance(obj, DTensor) else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
