"""What the training loop does on the host between the device's work, in process (the CLI's own path, CPU, fp32):
Python's garbage collection at a fixed step cadence (`train.gc_interval`), and one host read of the step's
numbers before the optimizer step (on a GPU each read of a device tensor waits for the queued kernels)."""

from __future__ import annotations

import gc

from pathlib import Path

import pytest
import torch

from conftest import cli_inprocess, overrides, read_metrics
from llmcluster.train.trainer import Trainer

pytestmark = pytest.mark.slow


def train(capsys, root, run: str, *sets: str) -> list[dict]:
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--root", root,
                         *overrides("train.steps=6", "checkpoint.interval_steps=1000", f"run.name={run}", *sets))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return read_metrics(root, run)


def record_steps(monkeypatch) -> list[tuple[int, bool]]:
    """(step, whether Python's automatic gc was on) for every train_step the run makes."""
    steps: list[tuple[int, bool]] = []
    step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: steps.append((self.step + 1, gc.isenabled())) or step(self))
    return steps


@pytest.mark.parametrize("interval, collected", [(2, [0, 2, 4, 6]), (0, [])])
def test_gc_interval_collects_generation_1_on_cadence(capsys, monkeypatch, tiny_root, interval, collected):
    """interval 2: automatic gc off during the run, one collection at the start (0) and before steps 2, 4, 6,
    on again afterwards; 0: automatic gc left on, no collection of ours."""
    steps = record_steps(monkeypatch)
    calls: list[tuple[int, int]] = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append((len(steps) + 1 if steps else 0,
                                                                           generation)) or collect(generation))
    train(capsys, tiny_root, f"gc{interval}", f"train.gc_interval={interval}")
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6]
    assert [s for s, g in calls if g == 1] == collected, calls
    assert all(enabled == (interval == 0) for _, enabled in steps), steps
    assert gc.isenabled()


def test_one_host_read_before_the_optimizer_step(capsys, monkeypatch, tiny_root):
    """Reads of floating-point tensors to the host (item, tolist, float(), bool(), int()) in each step before the
    optimizer steps: the loss and the grad norm read together, once (main read them one at a time). The
    optimizer's own reads (AdamW's step count on CPU) come after and are not counted."""
    steps = record_steps(monkeypatch)
    reads: dict[int, int] = {}
    counting = [False]

    def counted(name):
        original = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            if counting[0] and self.is_floating_point():
                reads[len(steps)] = reads.get(len(steps), 0) + 1
            return original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        counted(name)
    step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: counting.__setitem__(0, True) or step(self))
    scaler_step = torch.amp.GradScaler.step
    monkeypatch.setattr(torch.amp.GradScaler, "step",
                        lambda self, *a, **k: counting.__setitem__(0, False) or scaler_step(self, *a, **k))
    records = train(capsys, tiny_root, "reads")
    counting[0] = False
    assert reads == {s: 1 for s in range(1, 7)}, reads
    assert [r["step"] for r in records] == list(range(1, 7)) and all(r["loss"] > 0 for r in records), records


@pytest.mark.parametrize("precision, explained", [("bf16", True), ("fp32", False)])
def test_cpu_16bit_mfu_says_why_it_reads_low(monkeypatch, precision, explained):
    """Issue 34: bf16 MFU on CPU reads 2-5% of the AMX matmul peak; the start line's peak note says why."""
    from llmcluster.config import cpus
    from llmcluster.train import metrics

    amx = (Path(__file__).parent / "data" / "cpuinfo" / "amx-sapphire.txt").read_text()   # a CPU with AMX bf16
    monkeypatch.setattr(cpus, "this_cpu_peak", lambda threads, prec: cpus.isa_peak(amx, threads, prec))
    flops, source = metrics.device_peak_flops(torch.device("cpu"), precision)
    assert flops > 0 and source.startswith("CPU ISA peak: ")
    assert ("a small model's step reaches a few % of it, docs/training.md" in source) == explained
