"""Low-bit optimizer states (issue 55): torchao.optim's AdamW8bit for a full and a LoRA run and AdamW4bit for a
LoRA run, saved through DCP (the moments as torchao's own classes, not dequantized), resumed bitwise from a
mid-run checkpoint; and the trust side of torchao's tensor subclasses: its import admits its own classes to
`torch.load(weights_only=True)`'s allow-list, and a checkpoint naming any other class is still refused. The
low-bit update compiles with inductor: the tests share one inductor cache (TORCHINDUCTOR_CACHE_DIR of this
module), so each compile is paid once (cold on 2 cores: ~35-45 s for the first case, the full 8-bit run; ~10-15 s
for each LoRA case, the 4-bit one's compile included; warm: a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import cli_inprocess, overrides, read_metrics

pytest.importorskip("torchao")
pytestmark = pytest.mark.timeout(900)
STEPS = ["train.steps=8", "checkpoint.interval_steps=4", "log.eval_interval=100", "log.interval=1"]


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def _train(capsys, root: Path, *items: str):
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--root", root, *overrides(*items))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _losses(root: Path, run: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(root, run) if "loss" in r}


def _moment_classes(step_dir: Path) -> dict[str, tuple[str, int]]:
    """Each saved AdamW moment (optim.state.<param>.exp_avg / exp_avg_sq) of a one-file DCP checkpoint: (its class
    as `torch.load(weights_only=True)` rebuilds it, as the resume does; its number of values)."""
    import io

    from llmcluster.checkpoint.safe_load import load_data, read_metadata_file

    md = read_metadata_file(step_dir / ".metadata")
    out = {}
    for index, info in md.storage_data.items():
        if index.fqn.startswith("optim.state.") and index.fqn.endswith(("exp_avg", "exp_avg_sq")):
            with open(step_dir / info.relative_path, "rb") as f:
                f.seek(info.offset)
                moment = load_data(io.BytesIO(f.read(info.length)))
            out[index.fqn] = (type(moment).__name__, moment.numel())
    return out


# LoRA rank 64: the tiny shape's q/o adapters are 64 x 64 = 4096 values, torchao's smallest quantized state
# (smaller tensors, k/v's 32-row B here, keep fp32 moments: at rank 4 a LoRA run has no low-bit state at all).
@pytest.mark.parametrize("kind, optimizer, extra", [("full", "adamw8bit", ()),
                                                    ("lora", "adamw8bit", ("train.lora.rank=64",)),
                                                    ("lora", "adamw4bit", ("train.lora.rank=64",))])
def test_low_bit_adamw_resumes_bitwise(capsys, tiny_root, kind, optimizer, extra):
    root, run, items = tiny_root, f"{optimizer}-{kind}", (*STEPS, f"train.optimizer={optimizer}", *extra)
    _train(capsys, root, *items, f"run.name={run}")
    _train(capsys, root, *items, f"run.name={run}-resumed", "train.stop_at=4")
    second = _train(capsys, root, *items, f"run.name={run}-resumed")
    assert "resumed from" in second.stdout and "step_4" in second.stdout
    ref, got = _losses(root, run), _losses(root, f"{run}-resumed")
    assert sorted(ref) == sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == ref[step], (step, got[step], ref[step])   # bitwise, not approximately
    assert ref[8] < ref[1]
    # torchao's rule: a tensor of at least 4096 values, whole blocks (256 values for 8-bit, 128 for 4-bit)
    quantized, block = {"adamw8bit": ("OptimState8bit", 256), "adamw4bit": ("OptimState4bit", 128)}[optimizer]
    moments = _moment_classes(root / "checkpoints" / f"{run}-resumed" / "step_4")
    assert moments and all(cls == (quantized if n >= 4096 and n % block == 0 else "Tensor")
                           for cls, n in moments.values()), moments
    assert any(cls == quantized for cls, _ in moments.values()), moments


def test_torchao_import_widens_weights_only_to_its_own_classes_and_nothing_else_loads():
    """torchao's import registers its tensor subclasses (OptimState8bit/4bit/Fp8, NF4Tensor, ...) with
    `torch.load(weights_only=True)`'s allow-list (docs/security.md lists them); a checkpoint entry naming any other
    class, a torchao one left off the list included, is still refused as not plain data."""
    import io

    import torch
    import torchao.optim
    from torchao.float8 import Float8LinearConfig
    from torchao.optim.subclass_8bit import OptimState8bit

    from llmcluster.checkpoint.safe_load import UnsafeCheckpoint, load_data

    def saved(obj) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return buf

    safe = {f"{c.__module__}.{c.__qualname__}" for c in (g[0] if isinstance(g, tuple) else g
                                                          for g in torch.serialization.get_safe_globals())
            if isinstance(c, type)}
    assert {"torchao.optim.subclass_8bit.OptimState8bit", "torchao.optim.subclass_4bit.OptimState4bit",
            "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor"} <= safe
    state = OptimState8bit.zeros((4096,), signed=True, block_size=256)
    assert isinstance(load_data(saved(state)), OptimState8bit)     # an 8-bit moment loads as data
    for other in (Float8LinearConfig(), torchao.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(2))]),
                  Path("/etc/passwd")):
        with pytest.raises(UnsafeCheckpoint, match="not plain data"):
            load_data(saved(other))
