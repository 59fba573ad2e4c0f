"""Low-bit optimizer states (issue 55): torchao.optim's AdamW8bit for a full and a LoRA run, saved through DCP,
resumed bitwise from a mid-run checkpoint; and the trust side of torchao's tensor subclasses: its import admits
its own classes to `torch.load(weights_only=True)`'s allow-list, and a checkpoint naming any other class is still
refused. The 8-bit update compiles with inductor: the tests share one inductor cache (TORCHINDUCTOR_CACHE_DIR of
this module), so the compile is paid once (cold: ~20-40 s on 2 cores; warm: a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import cli_inprocess, overrides, read_metrics

pytest.importorskip("torchao")
pytestmark = pytest.mark.timeout(900)
STEPS = ["train.steps=8", "checkpoint.interval_steps=4", "log.eval_interval=100", "log.interval=1",
         "train.optimizer=adamw8bit"]


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


@pytest.mark.parametrize("kind, extra", [("full", ()), ("lora", ("train.lora.rank=4",))])
def test_adamw8bit_resumes_bitwise(capsys, tiny_root, kind, extra):
    root = tiny_root
    _train(capsys, root, *STEPS, *extra, f"run.name=a8-{kind}")
    _train(capsys, root, *STEPS, *extra, f"run.name=a8-{kind}-resumed", "train.stop_at=4")
    second = _train(capsys, root, *STEPS, *extra, f"run.name=a8-{kind}-resumed")
    assert "resumed from" in second.stdout and "step_4" in second.stdout
    ref, got = _losses(root, f"a8-{kind}"), _losses(root, f"a8-{kind}-resumed")
    assert sorted(ref) == sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == ref[step], (step, got[step], ref[step])   # bitwise, not approximately
    assert ref[8] < ref[1]


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
