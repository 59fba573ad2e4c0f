"""The seeded init (model/init.py): each weight is a pure function of (seed, name, element index), drawn on
the CPU in blocks. Any slice drawn alone equals that slice of the whole weight, bit for bit (so an FSDP or
TP rank draws only its own: tests/test_meta_init.py runs the real meshes); the values do not change with
the CPU's instruction set; and weights on a non-CPU device get exactly the CPU draw."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from conftest import REPO, cli_env
from llmcluster.config.load import load_job_config
from llmcluster.model import init as seeded
from llmcluster.model import llama
from llmcluster.model.llama import build_model
from llmcluster.train.parallelize import _fill_own_shard

SHAPE = (37, 23)
BLOCK = 64  # small blocks, so every slice below crosses block boundaries


def _whole():
    return seeded.draw(7, "w", SHAPE, 0.02, block=BLOCK)


@pytest.mark.parametrize("rows,cols", [
    (torch.arange(10, 19), None),                           # FSDP Shard(0): consecutive rows
    (None, torch.arange(12, 23)),                           # TP Shard(1): a column range
    (torch.arange(19, 28), torch.arange(0, 12)),            # FSDP x TP
    (torch.tensor([3, 4, 20, 21, 36]), torch.tensor([0, 5, 22])),  # strided splits, any order
    (torch.tensor([30, 2, 11]), torch.tensor([22, 1])),
])
def test_any_slice_drawn_alone_equals_that_slice_of_the_whole(rows, cols):
    whole = _whole()
    part = seeded.draw(7, "w", SHAPE, 0.02, rows=rows, cols=cols, block=BLOCK)
    r = rows if rows is not None else torch.arange(SHAPE[0])
    c = cols if cols is not None else torch.arange(SHAPE[1])
    assert part.shape == (len(r), len(c)) and part.dtype == torch.float32
    assert torch.equal(part, whole[r][:, c])


def test_values_depend_on_seed_and_name_and_look_normal():
    a = seeded.draw(7, "w", (256, 256), 1.0)
    assert not torch.equal(a, seeded.draw(8, "w", (256, 256), 1.0))
    assert not torch.equal(a, seeded.draw(7, "v", (256, 256), 1.0))
    assert abs(a.mean().item()) < 0.01 and abs(a.std().item() - 1.0) < 0.01
    assert abs((a.abs() > 1.959964).float().mean().item() - 0.05) < 0.003  # the tails too, not only the body


def test_a_row_slice_generates_only_the_blocks_it_covers(monkeypatch):
    """Memory and work by construction: a rank's slice costs its own blocks (+1 at each end), one at a
    time; the output is the slice."""
    made = []
    real = seeded.block_bits
    monkeypatch.setattr(seeded, "block_bits", lambda *a, **k: made.append(a[2]) or real(*a, **k))
    rows = torch.arange(20, 30)  # 10 of 37 rows: flat elements 460..690 of 851
    part = seeded.draw(7, "w", SHAPE, 0.02, rows=rows, block=BLOCK)
    assert part.numel() == 10 * SHAPE[1]
    assert made == list(range(460 // BLOCK, 689 // BLOCK + 1))  # each block once, none outside the slice
    assert torch.equal(part, _whole()[20:30])


_DIGEST = ("import hashlib, torch; from llmcluster.model import init;"
           "print(torch.backends.cpu.get_cpu_capability(),"
           " hashlib.sha256(init.draw(3, 'x', (300, 200), 0.02, block=4096).numpy().tobytes()).hexdigest())")


def test_values_do_not_depend_on_the_cpu_instruction_set():
    """torch's own float32 normal_ differs between ATEN_CPU_CAPABILITY=default and avx2 on one machine
    (and so between hosts); this draw must not."""
    out = {}
    for cap in ("default", "avx2"):
        proc = subprocess.run([sys.executable, "-c", _DIGEST], cwd=REPO, capture_output=True, text=True,
                              env=cli_env(ATEN_CPU_CAPABILITY=cap), timeout=120)
        assert proc.returncode == 0, proc.stderr
        used, digest = proc.stdout.split()
        out[used] = digest
    assert len(set(out.values())) == 1, out


def test_weights_on_another_device_are_the_cpu_draw(monkeypatch):
    """The device path: the trainer materialises the model on its device (CUDA on a GPU; the meta device
    stands in for it here: there is no GPU) and fills it with `_fill_own_shard`. Every weight's values must
    come from the CPU block draw, unchanged: nothing in the path depends on the device."""
    cfg = load_job_config("llm_tiny", ["model.n_layers=2", "model.d_model=64", "model.n_heads=4",
                                       "model.n_kv_heads=2", "model.ffn_hidden=128", "model.vocab_size=320"])
    drawn: dict[str, torch.Tensor] = {}
    real = seeded.draw

    def spy(seed, name, shape, scale, *a, **k):
        out = real(seed, name, shape, scale, *a, **k)
        drawn[name] = out
        return out

    monkeypatch.setattr(llama, "seeded_draw", spy)  # a spy: the real draw runs
    model = build_model(cfg.model, device="meta")
    model.to_empty(device="meta")
    model.init_weights(5, fill=_fill_own_shard)
    monkeypatch.undo()

    ref = build_model(cfg.model, device="cpu", seed=5)
    weights = {n: p for n, p in ref.named_parameters() if p.dim() == 2}
    assert set(drawn) == set(weights)
    for name, p in weights.items():
        assert drawn[name].device.type == "cpu"
        assert torch.equal(drawn[name], p), name


def test_draw_is_pinned():
    """A seed names a start point across hosts and releases: a change to the draw shows here."""
    got = hashlib.sha256(seeded.draw(3, "x", (300, 200), 0.02, block=4096).numpy().tobytes()).hexdigest()
    assert got == "50f38d86244249c5573390eb57a5d2700f5fbbeb8ae9c580dab422d27f1df6d7"
