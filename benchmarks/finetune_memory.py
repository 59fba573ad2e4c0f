"""Fine-tuning memory and step time on CPU, through the trainer itself (issue 55): full fine-tuning, LoRA on an
fp32 base, LoRA on a bf16 base and QLoRA (NF4 base), each with AdamW, full and QLoRA also with torchao's 8-bit
AdamW; on the tests' tiny NF4-compatible shape and a mid-size one.

How. A storage root in a temporary directory with a byte-tokenized dataset (the stdlib's json and email
packages). Per shape, the base model every method starts from: one step of a freshly initialised Llama,
exported to Hugging Face format (`llmcluster train`, `llmcluster export`), then each method's
`train.init_from`. Each (shape, method, optimizer) runs in a process of its own, so its resident set is its own:
it builds the trainer as `llmcluster train` does (`Trainer`: the base read from init_from, NF4 quantized
weight by weight, the LoRA adapters, the optimizer), runs `--warmup` steps untimed (the 8-bit update compiles
in the first) and `--steps` timed ones (`Trainer.train_step`: forward, backward, clip, optimizer step); the
step time is their median. After the last step it counts the bytes of the real objects: parameters (an NF4
weight's inner tensors), gradients, optimizer states (torchao's quantized moments: codes and scales; AdamW's
step counters included), and the resident set's growth from just before the trainer was built, at the end and
at its peak (glibc keeps freed buffers in a training process: distributed/cpu_memory.py). Next to each count,
the planner's figure for the same shape and method (plan/finetune.py `model_state_bytes`) and the ratio
planner / counted. LoRA: rank 8 on all seven projections (the planner's assumption). bf16 autocast where the
CPU computes bf16 natively, else fp32 (the trainer's rule, stated in `precision`).

The machine these figures come from is usually shared (2 cores): the step times are indicative, the byte
counts exact. Prints one JSON line (and writes it to --json).

    python benchmarks/finetune_memory.py [--shapes tiny,mid] [--steps 5] [--warmup 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Both NF4-compatible: every projection (and its FSDP half) is whole 64 x 256 NF4 blocks.
SHAPES = {
    "tiny": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, ffn_hidden=512),      # tests/test_qlora.py's
    "mid": dict(n_layers=4, d_model=1024, n_heads=16, n_kv_heads=8, ffn_hidden=4096),    # ~63M params
}
# (method, train.lora.base_precision or None, optimizer)
CASES = [("full", None, "adamw"), ("full", None, "adamw8bit"), ("lora", "fp32", "adamw"),
         ("lora", "bf16", "adamw"), ("qlora", "nf4", "adamw"), ("qlora", "nf4", "adamw8bit")]
LORA = "train.lora={rank: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"


def common(root: Path, a) -> list[str]:
    return ["data.dataset=text", f"data.seq_len={a.seq_len}", f"train.micro_batch={a.micro_batch}",
            "train.device=cpu", "train.precision=bf16", "checkpoint.interval_steps=100000",
            "log.eval_interval=100000", "log.progress=false"]


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "llmcluster", *args], cwd=REPO, check=True, capture_output=True,
                   text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def prepare(root: Path, a) -> dict[str, Path]:
    """The storage root, its dataset, and per shape the exported base model."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    cli("storage", "init", "--root", str(root))
    cli("data", "prepare", "--root", str(root), "--name", "text", "--source", str(stdlib / "json"),
        str(stdlib / "email"), "--tokenizer", "byte", "--val-fraction", "0.1")
    job = root / "job.yaml"
    job.write_text("run: {name: base}\n")
    bases = {}
    for name in a.shapes:
        shape = [f"model.{k}={v}" for k, v in SHAPES[name].items()] + [f"model.max_seq_len={a.seq_len}"]
        items = [*common(root, a), *shape, "train.steps=1", f"run.name=base-{name}"]
        cli("train", "--config", str(job), "--root", str(root), "--resume", "never",
            *(x for kv in items for x in ("--set", kv)))
        bases[name] = root / "hf" / name
        cli("export", "--run", f"base-{name}", "--root", str(root), "--out", str(bases[name]))
    return bases


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(root: Path, base: Path, method: str, base_precision: str | None, optimizer: str, a) -> dict:
    """In this process: the trainer for one case, its median step time and its counted bytes."""
    import torch

    from llmcluster.config.load import load_job_config
    from llmcluster.plan.finetune import model_state_bytes
    from llmcluster.plan.spec import ModelSpec
    from llmcluster.train.qlora import tensor_bytes
    from llmcluster.train.trainer import Trainer

    items = [*common(root, a), f"train.init_from={base}", f"train.optimizer={optimizer}",
             f"run.name={method}-{base_precision or 'fp32'}-{optimizer}", f"train.steps={a.warmup + a.steps}"]
    if base_precision:
        items += [LORA, f"train.lora.base_precision={base_precision}"]
    cfg = load_job_config(str(root / "job.yaml"), items)
    before = rss_bytes()
    trainer = Trainer(cfg, root, resume="never")
    try:
        trainer.model.train()
        times = []
        for _ in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t0)
        params = list(trainer.raw_model.parameters())   # a tied head is the embedding: counted once
        counted = {"weights": sum(tensor_bytes(p) for p in params),
                   "gradients": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
                   "optimizer": sum(tensor_bytes(v) for s in trainer.optimizer.state.values() for v in s.values()
                                    if isinstance(v, torch.Tensor))}
        rss, peak = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        trainer.close("completed")
    spec = ModelSpec(**cfg.model.model_dump(), seq_len=cfg.data.seq_len)
    planned = dict(zip(("weights", "gradients", "optimizer"),
                       model_state_bytes(spec, "full" if method == "full" else "lora", base_precision, optimizer)))
    counted["total"], planned["total"] = sum(counted.values()), sum(planned.values())
    return {"method": method if method != "lora" else f"lora-{base_precision}", "optimizer": optimizer,
            "precision": cfg.train.precision,
            "step_s": round(statistics.median(times[a.warmup:]), 4), "first_step_s": round(times[0], 2),
            "counted_bytes": counted, "planned_bytes": {k: round(v) for k, v in planned.items()},
            "planned_over_counted": {k: round(planned[k] / counted[k], 4) if counted[k] else None for k in counted},
            "model_params": sum(p.numel() for p in params), "rss_before_bytes": before,
            "rss_growth_bytes": rss - before, "peak_rss_growth_bytes": peak - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny,mid", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--steps", type=int, default=5, help="timed steps (their median is the step time)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (the 8-bit compile, allocator)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--json", help="also write the JSON here")
    ap.add_argument("--one", help=argparse.SUPPRESS)   # internal: root, base, case (JSON): measure it here
    a = ap.parse_args()
    a.shapes = a.shapes.split(",")
    if unknown := [s for s in a.shapes if s not in SHAPES]:
        ap.error(f"unknown shape(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    if a.one:
        root, base, case = json.loads(a.one)
        print(json.dumps(measure(Path(root), Path(base), *case, a)))
        return
    t0 = time.time()
    out: dict = {"device": "cpu", "threads": os.cpu_count(), "seq_len": a.seq_len, "micro_batch": a.micro_batch,
                 "steps": a.steps, "warmup": a.warmup, "lora": {"rank": 8, "targets": "all 7 projections"},
                 "note": "step times on a shared machine are indicative; byte counts are exact", "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="finetune-memory-") as tmp:
        root = Path(tmp) / "storage"
        bases = prepare(root, a)
        for name in a.shapes:
            rows = []
            for case in CASES:
                cmd = [sys.executable, __file__, "--one", json.dumps([str(root), str(bases[name]), case]),
                       "--steps", str(a.steps), "--warmup", str(a.warmup), "--seq-len", str(a.seq_len),
                       "--micro-batch", str(a.micro_batch)]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"finetune_memory: {name} {case} failed:\n{proc.stderr[-3000:]}")
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            out["shapes"][name] = {**SHAPES[name], "rows": rows}
    out["wall_s"] = round(time.time() - t0, 1)
    line = json.dumps(out)
    print(line)
    if a.json:
        Path(a.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
