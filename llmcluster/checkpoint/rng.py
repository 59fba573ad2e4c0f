"""Each rank's torch / numpy / python (/ CUDA) RNG state as JSON: rng/rank_<r>.json in a checkpoint, so a
resume at the same world size continues every random stream exactly (and loading it runs no pickle)."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def rng_state() -> dict:
    state = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
             "numpy": _jsonable(np.random.get_state()), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return {"__nd__": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    return x


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1]["__nd__"], dtype=n[1]["dtype"]), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(state["cuda"]),
                                                                dtype=np.uint8).copy()))
