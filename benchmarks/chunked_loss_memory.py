"""Peak memory of the cross-entropy at a Llama-3 vocabulary (128,256): in one piece vs `train.loss_chunks`.

Each measurement runs in its own fresh process, so that one cannot inherit the other's high-water mark:
the head's input (B·T × d_model) and weight are made, then forward + backward of the summed loss run once,
and the peak above what was held before the loss is reported. On CUDA the peak is torch's
`max_memory_allocated`; on CPU the process's maximum resident set (`getrusage` ru_maxrss: allocations go
straight to the OS at these sizes, and tracemalloc does not see torch's allocator). The fp32 logits alone are
B·T·V·4 bytes, printed for scale.

    python benchmarks/chunked_loss_memory.py --tokens 1024 --chunks 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import torch


def measure(tokens: int, vocab: int, dim: int, chunks: int, device: str) -> dict:
    """In this process: peak bytes of one forward + backward of the loss, above what was held before it."""
    from llmcluster.model.loss import head_loss

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    head = torch.nn.Linear(dim, vocab, bias=False, device=device, dtype=dtype)
    h = torch.randn(1, tokens, dim, device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, vocab, (1, tokens), device=device)
    # Warm up on 8 positions first: kernels, the autograd engine's threads and the allocator's first pools
    # are then not counted as the loss's memory.
    head_loss(head, h[:, :8].detach().requires_grad_(), y[:, :8], 1).backward()
    head.weight.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    loss = head_loss(head, h, y, chunks)
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"chunks": chunks, "peak_above_inputs_bytes": peak - before, "loss": float(loss)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1024, help="B·T positions in the micro-batch")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dim", type=int, default=512, help="d_model (the head's input width)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure this chunk count here
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(measure(a.tokens, a.vocab, a.dim, a.one, a.device)))
        return
    rows = []
    for chunks in (1, a.chunks):
        cmd = [sys.executable, __file__, "--tokens", str(a.tokens), "--vocab", str(a.vocab), "--dim", str(a.dim),
               "--device", a.device, "--one", str(chunks)]
        # CPU: glibc raises its mmap threshold after each large free (up to 32 MiB), so freed slices stay in the
        # heap and the resident set measures fragmentation; a fixed threshold returns every large block at once.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout))
    logits_fp32 = a.tokens * a.vocab * 4
    out = {"device": a.device, "tokens": a.tokens, "vocab": a.vocab, "dim": a.dim, "logits_fp32_bytes": logits_fp32,
           "rows": rows, "ratio": rows[0]["peak_above_inputs_bytes"] / max(1, rows[1]["peak_above_inputs_bytes"])}
    for r in rows:
        print(f"{a.device} B·T={a.tokens} V={a.vocab}: loss_chunks={r['chunks']:>3}  peak +"
              f"{r['peak_above_inputs_bytes'] / 2**20:8.1f} MiB  ({r['peak_above_inputs_bytes'] / logits_fp32:.2f}× "
              f"the fp32 logits)  loss {r['loss']:.4f}")
    print(f"in one piece / chunked: {out['ratio']:.1f}×")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
