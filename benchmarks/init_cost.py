"""What the seeded init costs one rank's host: time and peak RSS to initialise one Llama block plus the
embedding at Llama-3-8B width (d 4096, ffn 14336, 32/8 heads, vocab 128256), drawing

- whole:  every weight whole, then keeping this rank's FSDP slice (what a rank would do without the
          counter-based draw: the 70B embedding is 4.2 GB transient per rank),
- sliced: only this rank's slice (rows of an FSDP Shard(0), `--shards` ways), as the trainer does now,
- normal_: torch's float32 `normal_` of every whole weight (the old CPU draw; not the same bits on every
          host, shown for its speed only).

Each mode runs in a fresh process on one thread (torchrun's default), so its peak RSS is its own. The
ratios are within this run. Prints one JSON line.
    python benchmarks/init_cost.py [--shards 8] [--layers 1] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shapes(d: int, ffn: int, heads: int, kv: int, vocab: int, layers: int) -> dict[str, tuple[int, int]]:
    hd = d // heads
    out = {"embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        attn = {"q_proj": (d, d), "k_proj": (kv * hd, d), "v_proj": (kv * hd, d), "o_proj": (d, d)}
        mlp = {"gate_proj": (ffn, d), "up_proj": (ffn, d), "down_proj": (d, ffn)}
        out |= {f"layers.{i}.self_attn.{k}.weight": v for k, v in attn.items()}
        out |= {f"layers.{i}.mlp.{k}.weight": v for k, v in mlp.items()}
    return out


def run_mode(mode: str, weights: dict[str, tuple[int, int]], shards: int) -> dict:
    import torch

    from llmcluster.model import init as seeded

    torch.set_num_threads(1)  # torchrun's default (OMP_NUM_THREADS=1) for a rank among several
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kept, t0 = [], time.perf_counter()
    for name, shape in weights.items():
        rows = torch.arange(shape[0]).tensor_split(shards)[0]  # rank 0's FSDP rows
        if mode == "sliced":
            kept.append(seeded.draw(0, name, shape, 0.02, rows=rows))
        elif mode == "whole":
            kept.append(seeded.draw(0, name, shape, 0.02)[rows].clone())
        else:
            gen = torch.Generator().manual_seed(0)
            kept.append(torch.empty(shape).normal_(0.0, 0.02, generator=gen)[rows].clone())
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    return {"seconds": round(seconds, 2), "peak_rss_mib": round(peak / 1024, 1),
            "kept_mib": round(sum(t.numel() for t in kept) * 4 / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--modes", default="sliced,whole,normal_")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    weights = shapes(4096, 14336, 32, 8, a.vocab, a.layers)
    if a.one:
        print(json.dumps(run_mode(a.one, weights, a.shards)))
        return
    out = {"model": f"Llama-3-8B width, {a.layers} block(s) + embedding (vocab {a.vocab})",
           "elements": sum(r * c for r, c in weights.values()), "shards": a.shards}
    for mode in a.modes.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", mode, "--shards", str(a.shards),
                               "--layers", str(a.layers), "--vocab", str(a.vocab)],
                              capture_output=True, text=True, check=True, cwd=REPO)
        out[mode] = json.loads(proc.stdout)
    if "sliced" in out and "whole" in out:
        out["whole_over_sliced"] = {k: round(out["whole"][k] / max(out["sliced"][k], 1e-9), 2)
                                    for k in ("seconds", "peak_rss_mib")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
