"""QLoRA (issue 55): the frozen base of a LoRA run in fp32, bf16 or NF4 (train/qlora.py), started from an exported
Hugging Face checkpoint of a tiny NF4-compatible shape (d_model 256, 4 heads, 2 KV heads, ffn 512: every
projection is a multiple of NF4's 64 x 256 blocks, and so is each FSDP half-row shard), 30 steps each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line_error, cli_env, cli_inprocess, read_metrics
from hf_helpers import make_hf_storage

pytestmark = pytest.mark.timeout(900)
transformers = pytest.importorskip("transformers")
pytest.importorskip("torchao")
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, rope_scaling=False, max_shard_size=None)
LORA = "train.lora={rank: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"


def job(model: Path, run: str, *extra: str) -> list[str]:
    items = ["data.dataset=corpus", "data.kind=text", "data.seq_len=32", f"train.init_from={model}",
             "train.micro_batch=4", "train.precision=bf16", "train.warmup_steps=0", "train.schedule=constant",
             "train.lr=3e-3", "train.device=cpu", "log.interval=1", "log.eval_interval=1000",
             "log.eval_batches=1", "log.progress=false", f"run.name={run}", LORA, *extra]
    cfg = model.parent / "job.yaml"
    cfg.write_text("checkpoint: {interval_steps: 1000}\n")
    return ["--config", str(cfg), *(a for kv in items for a in ("--set", kv))]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_storage(tmp_path_factory.mktemp("qlora"), **SHAPE)


def _late_mean(root: Path, run: str) -> float:
    losses = [r["loss"] for r in read_metrics(root, run) if "loss" in r]
    assert len(losses) == 30, losses
    return sum(losses[20:30]) / 10


def test_nf4_weight_is_quantized_whole_and_fits_check():
    from llmcluster.checkpoint.nf4_base import nf4_fits, nf4_module
    from llmcluster.train.qlora import BYTES_PER_PARAM

    assert nf4_fits((256, 512)) and nf4_fits((256, 512), shards=2) and not nf4_fits((192, 192))
    assert not nf4_fits((64, 256 * 3), shards=2)   # 48 rows... of 64 x 768: 3 scaler blocks, not split in 2
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    q = nf4_module().to_nf4(w, 64, 256)
    nbytes = sum(t.numel() * t.element_size() for t in (q.quantized_data, q.quantized_scalers,
                                                      q.quantization_factor, q.scaler_mean))
    assert abs(nbytes / w.numel() - BYTES_PER_PARAM["nf4"]) < 0.002, nbytes


def test_base_precisions_train_alike(capsys, hf):
    """30 steps each from the same HF checkpoint: the NF4 base's mean loss over steps 21-30 within 2% of the
    bf16 base's, the bf16 base's within 0.5% of the fp32 base's."""
    root, model = hf["root"], hf["model"]
    lines = {}
    for kind in ("fp32", "bf16", "nf4"):
        proc = cli_inprocess(capsys, "train", "--root", root, "--resume", "never",
                             *job(model, f"base-{kind}", "train.steps=30", f"train.lora.base_precision={kind}"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines[kind] = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LoRA base"))
    assert "NF4 (block 64, scaler block 256: 0.516 bytes/param)" in lines["nf4"], lines["nf4"]
    assert "at 2 bytes/param" in lines["bf16"] and "at 4 bytes/param" in lines["fp32"], lines
    m = {k: _late_mean(root, f"base-{k}") for k in lines}
    print(f"mean loss steps 21-30: {m}")
    first = read_metrics(root, "base-fp32")[0]["loss"]
    assert m["fp32"] < first - 0.1, (first, m)          # the adapters learn
    assert abs(m["bf16"] - m["fp32"]) / m["fp32"] < 0.005, m
    assert abs(m["nf4"] - m["bf16"]) / m["bf16"] < 0.02, m


@pytest.fixture(scope="module")
def nf4_two_ranks(hf, tmp_path_factory):
    """10 fp32 steps of an NF4 base, FSDP2 over gloo on 2 ranks (with parallel.fsdp_offload: FSDP2's
    CPUOffloadPolicy, accepted on CPU, where it changes nothing), through this file's entry below: (the run,
    each rank's peak of whole NF4 weights alive)."""
    out = tmp_path_factory.mktemp("nf4-count")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "train", "--root", str(hf["root"]), "--resume", "never",
           *job(hf["model"], "nf4-2", "train.steps=10", "train.lora.base_precision=nf4", "train.precision=fp32",
                "train.micro_batch=2", "parallel.dp_shard=2", "parallel.fsdp_offload=true")]
    proc = subprocess.run(cmd, cwd=Path.cwd(), env=cli_env(NF4_COUNT_DIR=str(out)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_fsdp_nf4_two_ranks_equal_one(capsys, hf, nf4_two_ranks):
    """FSDP2 over gloo, 2 ranks, NF4 base: the loss of each of 10 steps equals the 1-rank run's within 1e-5;
    each rank's shard of a projection is an NF4Tensor of half the rows (the run's line after sharding)."""
    root, model = hf["root"], hf["model"]
    one = cli_inprocess(capsys, "train", "--root", root, "--resume", "never",
                        *job(model, "nf4-1", "train.steps=10", "train.lora.base_precision=nf4", "train.precision=fp32",
                             "train.micro_batch=4"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = nf4_two_ranks[0]
    assert "NF4 shard: layers.0.self_attn.q_proj.weight is an NF4Tensor of (128, 256) of (256, 256)" \
        in two.stdout, two.stdout[-3000:]
    a = [r["loss"] for r in read_metrics(root, "nf4-1") if "loss" in r]
    b = [r["loss"] for r in read_metrics(root, "nf4-2") if "loss" in r]
    assert len(a) == len(b) == 10
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_fsdp_nf4_rank_holds_one_whole_weight_at_most(nf4_two_ranks):
    """Each weight is quantized whole after FSDP2 has sharded the NF4 weights, and only this rank's rows of it
    are kept before the next one is read: at no time does a rank hold more than one whole NF4 weight, the
    largest (quantizing every weight before sharding any held all 14: both blocks' projections)."""
    from llmcluster.checkpoint.nf4_base import nf4_module
    from llmcluster.train.qlora import tensor_bytes

    d, ffn, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], 128    # 2 KV heads of 64
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn)]
    largest = max(tensor_bytes(nf4_module().to_nf4(torch.zeros(s, dtype=torch.bfloat16), 64, 256)) for s in shapes)
    for peak in nf4_two_ranks[1]:
        assert peak == {"bytes": largest, "tensors": 1, "made": 14}, (peak, largest)


@pytest.mark.parametrize("bad, needles", [
    (("parallel.tp=2", "train.lora.base_precision=nf4"), ("base_precision=nf4 with parallel.tp > 1",)),
    (("parallel.pp=2", "train.lora.base_precision=nf4"), ("base_precision=nf4 with parallel.pp > 1",)),
    (("parallel.pp=2", "train.lora.base_precision=bf16"), ("base_precision=bf16 with parallel.pp > 1",)),
    (("ft.enabled=true", "parallel.dp_replicate=2", "train.lora.base_precision=nf4"), ("nf4 with ft.enabled",)),
    (("train.optimizer=adamw8bit", "train.precision=fp16"), ("adamw8bit with train.precision=fp16",)),
    (("parallel.fsdp_offload=true", "parallel.dp_shard=1"), ("fsdp_offload needs FSDP",)),
])
def test_bad_combinations_are_one_line(capsys, hf, bad, needles):
    proc = cli_inprocess(capsys, "train", "--root", hf["root"], *job(hf["model"], "bad", *bad))
    assert_one_line_error(proc, *needles)


def test_nf4_without_torchao_is_one_line(capsys, hf, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    proc = cli_inprocess(capsys, "train", "--root", hf["root"], "--resume", "never",
                         *job(hf["model"], "no-torchao", "train.steps=1", "train.lora.base_precision=nf4"))
    assert_one_line_error(proc, "base_precision=nf4 needs torchao")


def _tensor_bytes(step_dir: Path) -> int:
    """The tensor bytes a DCP checkpoint holds (its metadata: every entry's shape and dtype)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return sum(m.size.numel() * torch.empty((), dtype=m.properties.dtype).element_size()
               for m in md.values() if isinstance(m, TensorStorageMetadata))


def _planned_checkpoint_bytes(model: Path) -> float:
    """The planner's checkpoint size for this file's NF4 job on the HF base at `model`."""
    import json

    from llmcluster.plan.finetune import checkpoint_bytes
    from llmcluster.plan.spec import ModelSpec, PlanCluster, PlanSpec

    hf = json.loads((model / "config.json").read_text())
    spec = ModelSpec(n_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], n_heads=hf["num_attention_heads"],
                     n_kv_heads=hf["num_key_value_heads"], ffn_hidden=hf["intermediate_size"],
                     vocab_size=hf["vocab_size"], tie_embeddings=hf.get("tie_word_embeddings", False), seq_len=32)
    lora = {"rank": 8, "alpha": 16, "base_precision": "nf4",
            "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
    return checkpoint_bytes(PlanSpec(model=spec, cluster=PlanCluster(gpu="RTX4090", nodes=1, gpus_per_node=1),
                                     training={"lora": lora}))


def test_nf4_checkpoint_holds_the_adapters_and_a_resume_requantizes(capsys, hf):
    """An NF4 run's checkpoint holds the adapters and their optimizer state, not the frozen base: a resume
    quantizes train.init_from again and continues bitwise; a resume that changes the base precision is refused."""
    root, model = hf["root"], hf["model"]
    nf4 = ("train.steps=6", "train.lora.base_precision=nf4", "checkpoint.interval_steps=3")
    for run, extra in (("q-ref", ()), ("q-res", ("train.stop_at=3",)), ("q-res", ())):
        proc = cli_inprocess(capsys, "train", "--root", root, *job(model, run, *nf4, *extra))
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_3" in proc.stdout
    meta = (root / "checkpoints" / "q-res" / "step_3" / ".metadata").read_bytes()
    assert b"lora_A" in meta and b"q_proj.weight" not in meta          # adapters only, no base weight
    # the planner's checkpoint size for the method (plan/finetune.checkpoint_bytes) is what the trainer wrote
    assert _planned_checkpoint_bytes(model) == pytest.approx(_tensor_bytes(root / "checkpoints" / "q-res" / "step_3"),
                                                             rel=0.03)
    ref = {r["step"]: r["loss"] for r in read_metrics(root, "q-ref") if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(root, "q-res") if "loss" in r}
    assert all(got[s] == ref[s] for s in range(4, 7)), (ref, got)   # bitwise
    bad = cli_inprocess(capsys, "train", "--root", root,
                        *job(model, "q-res", "train.steps=9", "train.lora.base_precision=bf16"))
    assert_one_line_error(bad, "base nf4 -> ")


def test_nf4_resume_over_other_base_weights_is_refused(capsys, hf, tmp_path):
    """The fingerprint of an NF4 run names the sha256 of train.init_from's safetensors: its checkpoint has no base,
    so a resume over changed weights would quietly train the adapters against another model."""
    import shutil

    root, model = hf["root"], hf["model"]
    other = shutil.copytree(model, tmp_path / "llama")
    nf4 = ("train.steps=4", "train.lora.base_precision=nf4", "train.stop_at=1")
    proc = cli_inprocess(capsys, "train", "--root", root, *job(model, "q-fp", *nf4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(other / "model.safetensors", "r+b") as f:   # one byte of the last tensor's data
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    bad = cli_inprocess(capsys, "train", "--root", root, *job(other, "q-fp", "train.steps=4",
                                                             "train.lora.base_precision=nf4"))
    assert_one_line_error(bad, "train.init_from's weights sha256")


def _count_whole_nf4(out: Path) -> None:
    """Wrap torchao's `to_nf4` (train/qlora.py quantizes each whole weight with it): the bytes of the NF4 tensors
    it made that are still alive, at their peak, in out/rank<RANK>.json (rewritten at each new peak)."""
    import weakref

    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    from llmcluster.train.qlora import tensor_bytes

    live: dict[int, int] = {}
    peak = {"bytes": 0, "tensors": 0, "made": 0}
    made = nf4_tensor.to_nf4

    def counted(w, *args):
        q = made(w, *args)
        if q.is_meta:   # shapes only (train/qlora.py prepare_base): no memory
            return q
        # Followed by its 4-bit data's storage: nn.Parameter(q) holds a detached NF4Tensor (another object,
        # the same storage), and FSDP2 copies this rank's rows into a shard of its own, freeing the whole.
        data = q.quantized_data.untyped_storage()
        live[id(data)] = tensor_bytes(q)
        weakref.finalize(data, live.pop, id(data))
        peak["made"] += 1
        if sum(live.values()) > peak["bytes"]:
            peak.update(bytes=sum(live.values()), tensors=len(live))
        (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(peak))
        return q
    nf4_tensor.to_nf4 = counted


if __name__ == "__main__":   # torchrun's entry in nf4_two_ranks: the CLI, with whole NF4 weights counted
    _count_whole_nf4(Path(os.environ["NF4_COUNT_DIR"]))
    from llmcluster.cli import main
    sys.exit(main(sys.argv[1:]))
