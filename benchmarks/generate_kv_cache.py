"""Greedy generation with and without the KV cache, on llm_tiny's shape (random weights: speed does not depend on
them), in the same process and run, alternating: the ratio is the cache's speed-up. Also checks the tokens agree.

    python benchmarks/generate_kv_cache.py --new-tokens 256 --prompt-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llmcluster.config.load import load_job_config
from llmcluster.export.generate import sample
from llmcluster.model.llama import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="llm_tiny")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_job_config(args.config).model
    model = build_model(cfg, seed=0).eval()
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def run(cache: bool) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = sample(model, prompt, args.new_tokens, 0.0, 0, cfg.max_seq_len, None, torch.Generator(), cache=cache)
        return time.perf_counter() - t, out

    run(True), run(False)   # warm-up: first-call allocations and kernel selection
    times: dict[bool, list[float]] = {True: [], False: []}
    outs = {}
    for _ in range(args.repeats):
        for cache in (True, False):
            s, outs[cache] = run(cache)
            times[cache].append(s)
    best = {k: min(v) for k, v in times.items()}
    print(json.dumps({
        "config": args.config, "n_layers": cfg.n_layers, "d_model": cfg.d_model, "prompt_tokens": args.prompt_tokens,
        "new_tokens": len(outs[True]), "threads": torch.get_num_threads(),
        "cached_s": best[True], "uncached_s": best[False],
        "cached_tokens_per_s": len(outs[True]) / best[True], "uncached_tokens_per_s": len(outs[False]) / best[False],
        "speedup": best[False] / best[True], "same_tokens": outs[True] == outs[False],
        "all_s": {"cached": times[True], "uncached": times[False]}}, indent=1))


if __name__ == "__main__":
    main()
