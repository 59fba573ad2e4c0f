"""What vLLM would accept at start-up and then fail or quietly change on the first request: said before launch.

vLLM loads a model its CPU attention kernel cannot run and dies on the first request (not at start-up, so a
health check passes); it applies generation_config.json's sampling fields to every request that does not set
them; and it answers /v1/chat/completions with 400 when the tokenizer has no chat template. `serve start` calls
engine_warnings() and prints each line before it launches. Only JSON is read (never templated). No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcluster.plan.served_model import ServedModel

# vLLM CPU (0.32) attention kernel: the head sizes it is compiled for
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# generation_config.json fields vLLM turns into per-request sampling defaults
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}   # a file we cannot read is the engine's to refuse, with its own message
    return data if isinstance(data, dict) else {}


def engine_warnings(m: ServedModel, cpu: bool) -> list[str]:
    """One line per thing the engine would refuse late or change silently for this model (on CPU when `cpu`)."""
    out = []
    hd = m.spec.head_dim
    if cpu and hd not in CPU_HEAD_DIMS:
        out.append(f"{m.name}: head dim {hd} is not one vLLM's CPU attention runs "
                   f"({', '.join(map(str, CPU_HEAD_DIMS))}): the server starts and fails on the first request")
    d = Path(m.source)
    if not d.is_dir():   # a preset: nothing on disk to read
        return out
    gen = _json(d / "generation_config.json")
    sampling = [k for k in SAMPLING_FIELDS if k in gen]
    if sampling and gen.get("do_sample", True) is not False:
        out.append(f"{d / 'generation_config.json'}: {', '.join(f'{k}={gen[k]}' for k in sampling)} become the "
                   "default of every request that does not set them, in place of the API's; re-export, or "
                   "remove them")
    conf = _json(d / "tokenizer_config.json")
    if (d / "tokenizer_config.json").is_file() and not conf.get("chat_template"):
        out.append(f"{m.name}: no chat template in tokenizer_config.json: /v1/chat/completions will answer 400 "
                   "(/v1/completions works)")
    return out
