"""Training-step throughput: llmcluster's Llama + trainer step vs Hugging Face `LlamaForCausalLM`.

Same shape (a job config's model section), same batch, precision, thread count, optimizer (AdamW) and
loss; one process. Runs are interleaved (A B, B A, A B, ...) because timings on shared machines drift by
±25% over minutes; each side reports the median of its timed steps after warm-up, and each ratio is the
median of the per-round ratios, with their range.

    python benchmarks/train_throughput.py             # llm_tiny, 2 threads, bf16 where native else fp32
    python benchmarks/train_throughput.py --hf-compile  # also transformers compiled whole

Sides: ours eager and ours compiled (per block, as the trainer compiles), each through the model's own loss
(what the trainer calls), against transformers' `LlamaForCausalLM` in the plain eager loop most people write;
both ratios are printed (issue 36's CPU target: ours compiled >= 1.3x). bf16 is only fast on CPUs with
avx512_bf16/AMX (or on GPU); `--precision auto` (the default) takes bf16 there and fp32 elsewhere and says
which. A figure for a note, not a test gate: 2 shared cores drift.

Each side also prints its minor page faults per step. glibc's malloc hands buffers of 32 MiB and more (the B·T·V
logits at this shape: 2048 x 4096 fp32) straight from mmap and returns them at free, so a side that
materialises them faults every page in again at every step. The trainer keeps freed buffers instead
(llmcluster/distributed/cpu_memory.py) and so does this benchmark, for both sides: the ratios compare the models
and their steps, not the allocator. `--glibc-defaults` leaves glibc as it is (the plain loop as most people run it:
there the sides that materialise the logits lose ~30% to page faults; docs/compat.md, "CPU training throughput").

Last, three profiled steps per side say how much of transformers' step is in the kernels both sides call (matmuls
and SDPA's attention): what fusing everything else can win is bounded by the rest (Amdahl).
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmcluster.config.load import load_job_config  # noqa: E402
from llmcluster.distributed.cpu_memory import allocator_chosen_by_user, keep_freed_memory  # noqa: E402
from llmcluster.model.flops import param_count  # noqa: E402
from llmcluster.model.llama import build_model  # noqa: E402
from llmcluster.distributed.process_groups import native_low_precision  # noqa: E402
from llmcluster.train.optimizer import build_optimizer  # noqa: E402
from llmcluster.train.parallelize import apply_compile  # noqa: E402


def hf_model(m, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    conf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_hidden,
                       num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                       num_key_value_heads=m.kv_heads, max_position_embeddings=m.max_seq_len,
                       rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
                       attention_bias=False, mlp_bias=False, attn_implementation="sdpa")
    return LlamaForCausalLM(conf).to(device)


def make_step(model, optimizer, device, precision: str, loss_of):
    ac = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
          else contextlib.nullcontext())

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        with ac:
            loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss.detach())
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llm_tiny", help="job config whose model section is the shape")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="auto: bf16 where this device has it natively, else fp32")
    ap.add_argument("--hf-compile", action="store_true", help="also time transformers compiled whole")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per round and side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's own)")
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave glibc's malloc as it is (by default freed buffers are kept, as the trainer does)")
    args = ap.parse_args()
    kept = not args.glibc_defaults and keep_freed_memory()

    cfg = load_job_config(args.config, args.overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if native_low_precision(device, "bf16") else "fp32"
        print(f"precision: {precision} ({'native bf16 here' if precision == 'bf16' else 'no native bf16 here'})")
    elif not native_low_precision(device, precision):
        print(f"note: {precision} is emulated on this CPU (no avx512_bf16/AMX): both sides run slowly; "
              "the ratio still compares like with like", file=sys.stderr)
    m = cfg.model
    train = cfg.train.model_copy(update={"lr": 1e-4})

    def ours_loss(mod, x, y):   # the trainer's call: the model's own loss (a sum), as a mean
        return mod(x, y) / y.numel()

    def hf_loss(mod, x, y):     # the plain loop: logits out, cross-entropy in fp32
        logits = mod(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    sides = {}
    for label, compiled in (("llmcluster eager", False), ("llmcluster compiled", True)):
        torch.manual_seed(0)
        ours = build_model(m, device="cpu", seed=0).to(device)
        if compiled and not apply_compile(ours, device):   # it warned why
            continue
        sides[label] = make_step(ours, build_optimizer(ours, train, device), device, precision, ours_loss)
    for label, compiled in (("transformers", False), ("transformers+compile", True)):
        if compiled and not args.hf_compile:
            continue
        theirs = hf_model(m, device)
        if compiled:
            theirs = torch.compile(theirs)
        sides[label] = make_step(theirs, build_optimizer(theirs, train, device), device, precision, hf_loss)
    gen = torch.Generator().manual_seed(0)
    xy = torch.randint(0, m.vocab_size, (args.batch, args.seq_len + 1), generator=gen).to(device)
    x, y = xy[:, :-1], xy[:, 1:]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    print(f"shape: {m.n_layers} layers, d {m.d_model}, {m.n_heads} heads ({m.kv_heads} kv), ffn {m.ffn_hidden}, "
          f"vocab {m.vocab_size} = {param_count(m) / 1e6:.1f}M params; batch {args.batch} × {args.seq_len}; "
          f"{precision}; {torch.get_num_threads()} threads; {device}; {args.rounds} interleaved rounds")
    times: dict[str, list[list[float]]] = {k: [] for k in sides}   # per side, per round: its timed steps
    faults = {k: 0 for k in sides}   # minor page faults over its timed steps
    names = list(sides)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            step, steps = sides[name], []
            for _ in range(args.warmup if r == 0 or args.warmup == 0 else 1):
                step(x, y)
            for _ in range(args.steps):
                sync()
                f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                step(x, y)
                sync()
                steps.append(time.perf_counter() - t0)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            times[name].append(steps)
    tokens = args.batch * args.seq_len
    for k, rounds in times.items():
        flat = [t for steps in rounds for t in steps]
        print(f"{k:21s} {tokens / statistics.median(flat):10,.0f} tokens/s  (median of {len(flat)} steps; "
              f"range {tokens / max(flat):,.0f}-{tokens / min(flat):,.0f}; "
              f"{faults[k] / len(flat):,.0f} page faults a step)")
    chosen = allocator_chosen_by_user()
    print("allocator: " + ("freed buffers kept, as the trainer does" if kept else
                           f"as chosen by {chosen}" if chosen else "glibc defaults (see the docstring)"))
    # A ratio per round (the two sides' medians minutes apart at most), then their median and range: the
    # machine's drift between rounds cancels instead of landing on whichever side ran during a slow spell.
    for ours_side in (k for k in times if k.startswith("llmcluster")):
        for k in (k for k in times if k.startswith("transformers")):
            per_round = sorted(statistics.median(t) / statistics.median(o)
                               for o, t in zip(times[ours_side], times[k]))
            print(f"ratio {ours_side} / {k}{' (eager, plain loop)' if k == 'transformers' else ''}: "
                  f"{statistics.median(per_round):.2f}x  (median of {len(per_round)} rounds; "
                  f"range {per_round[0]:.2f}-{per_round[-1]:.2f})")
    for k in sides:
        shared = shared_kernel_share(sides[k], x, y)
        bound = f": fusing all the rest away would give at most {1 / shared:.2f}x" if k == "transformers" else ""
        print(f"{k}: {shared:.0%} of profiled steps in matmuls and attention (kernels both sides call){bound}")
    return 0


SHARED_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")


def shared_kernel_share(step, x, y) -> float:
    """Share of three profiled steps' own CPU time spent in the matmul and attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step(x, y)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key.startswith(SHARED_KERNELS)) / max(total, 1)


if __name__ == "__main__":
    raise SystemExit(main())
