"""Start from a Hugging Face model: a small random Llama made with transformers (GQA, rope_theta 500000,
Llama 3 RoPE scaling, sharded safetensors) and a tokenizer made here; init_from, train, export, reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_one_line_error, cli_inprocess, read_metrics, run_cli, torchrun
from hf_helpers import make_hf_storage

pytestmark = pytest.mark.timeout(600)
transformers = pytest.importorskip("transformers")


def job(model: Path, run: str, *extra: str) -> list[str]:
    items = ["data.dataset=corpus", "data.kind=text", "data.seq_len=32", f"train.init_from={model}",
             "train.micro_batch=4", "train.precision=fp32", "train.warmup_steps=0", "train.schedule=constant",
             "train.device=cpu", "log.interval=1", "log.eval_interval=1000", "log.eval_batches=1",
             "log.progress=false", f"run.name={run}", *extra]
    cfg = model.parent / "job.yaml"  # no model section: init_from's config.json is the model
    cfg.write_text("checkpoint: {interval_steps: 1000}\n")
    return ["--config", str(cfg), *(a for kv in items for a in ("--set", kv))]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_hf_storage(tmp_path_factory.mktemp("hf"))


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(ids).logits


IDS = torch.randint(2, 300, (2, 96), generator=torch.Generator().manual_seed(0))  # past original_max_pos 32


def test_first_forward_matches_transformers(hf):
    from llmcluster.config.schema import ModelConfig
    from llmcluster.model.llama import build_model
    from llmcluster.train.hf_import import load_hf_weights, model_from_init

    cfg = model_from_init(ModelConfig(), hf["model"])
    assert (cfg.n_kv_heads, cfg.rope_theta, cfg.rope_scaling.factor) == (2, 500000.0, 8.0)
    ours = build_model(cfg, device="cpu", seed=1)
    assert len(json.loads((hf["model"] / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert load_hf_weights(ours, hf["model"]) == sum(p.numel() for p in ours.parameters())
    with torch.no_grad():
        diff = (ours(IDS) - _logits(hf["model"], IDS)).abs().max().item()
    assert diff < 1e-5, diff


def test_lr0_round_trip_then_training_lowers_loss(hf):
    root, model = hf["root"], hf["model"]
    run_cli("train", "--root", root, "--resume", "never", *job(model, "lr0", "train.lr=0", "train.steps=1"),
            check=True)
    run_cli("export", "--run", "lr0", "--root", root, check=True)
    out = root / "models" / "lr0"
    diff = (_logits(out, IDS) - _logits(model, IDS)).abs().max().item()
    assert diff < 1e-5, diff
    orig, exported = (json.loads((d / "config.json").read_text()) for d in (model, out))
    assert exported["transformers_version"] == orig["transformers_version"]  # kept, not ours to set
    assert exported["rope_parameters"]["rope_type"] == "llama3"
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (0, 1)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>"

    run_cli("train", "--root", root, "--resume", "never",
            *job(model, "ft", "train.lr=1e-3", "train.steps=20"), check=True)
    losses = [r["loss"] for r in read_metrics(root, "ft")]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    run_cli("export", "--run", "ft", "--root", root, check=True)
    assert (_logits(root / "models" / "ft", IDS) - _logits(model, IDS)).abs().max().item() > 1e-3


def test_fsdp_tp_ranks_load_their_slices(hf):
    """4 ranks, dp_shard 2 × tp 2: every weight is a DTensor whose rank-local slice comes from the files."""
    root, model = hf["root"], hf["model"]
    proc = torchrun(4, "train", "--root", root, "--resume", "never",
                    *job(model, "sharded", "train.lr=0", "train.steps=1", "parallel.dp_shard=2", "parallel.tp=2",
                         "train.micro_batch=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_cli("export", "--run", "sharded", "--root", root, check=True)
    diff = (_logits(root / "models" / "sharded", IDS) - _logits(model, IDS)).abs().max().item()
    assert diff < 1e-5, diff


def test_contradicting_model_key_is_one_line(capsys, hf):
    proc = cli_inprocess(capsys, "train", "--root", hf["root"], *job(hf["model"], "bad", "model.n_layers=3"))
    assert_one_line_error(proc, "model.n_layers=3 contradicts", "init_from")


def test_data_from_another_tokenizer_is_refused(capsys, hf, tiny_root):
    proc = cli_inprocess(capsys, "train", "--root", tiny_root,
                         *job(hf["model"], "bad2", "data.dataset=tiny", "data.kind=code"))
    assert_one_line_error(proc, "was not tokenized with", "--tokenizer")


LORA = "train.lora={rank: 4, alpha: 8, targets: [q_proj, v_proj, down_proj]}"


def test_lora_state_is_adapters_only_and_the_planner_counts_them():
    from llmcluster.config.schema import LoraConfig, ModelConfig, TrainConfig
    from llmcluster.model.llama import build_model
    from llmcluster.plan.memory import lora_model_states, lora_params, model_states
    from llmcluster.plan.spec import ModelSpec
    from llmcluster.model.lora import apply_lora, init_lora
    from llmcluster.train.optimizer import build_optimizer

    mc = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=160, vocab_size=300)
    model = build_model(mc, seed=0)
    lc = LoraConfig(rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    n = apply_lora(model, lc)
    init_lora(model, 0)
    spec = ModelSpec(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=160, vocab_size=300)
    assert n == lora_params(spec, 4, lc.targets) == 2 * 4 * ((64 + 64) + (64 + 32) + (160 + 64))
    opt = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == n
    model(torch.randint(0, 300, (2, 8))).sum().backward()
    assert all((p.grad is not None) == (".lora_" in k) for k, p in model.named_parameters())
    w, g, o = lora_model_states(1e9, 1e6, dp=1, zero=0)
    assert (w, g, o) == (2e9 + 2e6, 2e6, 12e6)  # zero-paper bytes: no gradient/optimizer for the base
    assert lora_model_states(1e9, 0, dp=4, zero=3)[0] == model_states(1e9, 4, 3)[0]


def test_lora_trains_adapters_only_and_the_peft_adapter_loads(hf):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from llmcluster.config import load_job_config
    from llmcluster.model.llama import build_model
    from llmcluster.checkpoint.checkpointer import load_model_weights
    from llmcluster.train.hf_import import model_from_init
    from llmcluster.model.lora import apply_lora

    root, model = hf["root"], hf["model"]
    run_cli("train", "--root", root, "--resume", "never",
            *job(model, "lora", "train.lr=1e-2", "train.steps=20", LORA), check=True)
    losses = [r["loss"] for r in read_metrics(root, "lora")]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    # The checkpoint's base weights are the original ones, bit for bit; only the adapters moved.
    cfg = load_job_config(None, [f"train.init_from={model}", LORA])
    ours = build_model(model_from_init(cfg.model, model), device="cpu")
    apply_lora(ours, cfg.train.lora)
    load_model_weights(root / "checkpoints" / "lora" / "step_20", ours)
    orig = {}
    for f in model.glob("model-*.safetensors"):
        orig.update(load_file(str(f)))
    changed = 0
    for k, v in ours.state_dict().items():
        if ".lora_" in k:
            changed += int(k.endswith("lora_B") and v.abs().max() > 0)
        else:
            hf_key = k if k.startswith("lm_head") else "model." + k
            assert torch.equal(v, orig[hf_key]), k
    assert changed == 2 * 3
    run_cli("export", "--run", "lora", "--root", root, check=True)
    out = root / "models" / "lora"
    merged = _logits(out, IDS)
    assert (merged - _logits(model, IDS)).abs().max().item() > 1e-4
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        diff = (adapted(IDS).logits - merged).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("change,needle", [({"attention_bias": True}, "attention_bias"),
                                           ({"model_type": "gpt2"}, "model_type 'gpt2'"),
                                           ({"head_dim": 32}, "head_dim 32")])
def test_unsupported_hf_configs_are_one_line(capsys, hf, tmp_path, change, needle):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(hf["model"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    assert_one_line_error(cli_inprocess(capsys, "train", "--root", hf["root"], *job(d, "unsup")), needle)


def test_lora_under_fsdp_matches_one_process(hf):
    """Adapters sharded with their block (2 FSDP ranks) train as on one process: seeded whole, sliced."""
    root, model = hf["root"], hf["model"]
    common = ("train.lr=1e-2", "train.steps=3", LORA)
    run_cli("train", "--root", root, "--resume", "never", *job(model, "lora1", *common), check=True)
    proc = torchrun(2, "train", "--root", root, "--resume", "never",
                    *job(model, "lora2", *common, "parallel.dp_shard=2", "train.micro_batch=2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = ({r["step"]: r["loss"] for r in read_metrics(root, run)} for run in ("lora1", "lora2"))
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for step in one:
        assert abs(one[step] - two[step]) < 1e-4, (step, one[step], two[step])


def test_lora_with_tensor_parallelism_is_refused():
    from llmcluster.config import load_job_config
    from llmcluster.errors import UserError

    with pytest.raises(UserError, match="train.lora with parallel.tp > 1"):
        load_job_config(None, ["train.lora={rank: 2}", "parallel.tp=2"])


@pytest.mark.parametrize("entry", ["ABS", "../outside.safetensors", "sub/x.safetensors", "LINK"])
def test_an_index_entry_outside_the_base_is_one_line(hf, tmp_path, capsys, entry):
    """Issue 65: a base's model.safetensors.index.json names files of the base only: an absolute entry, a `../`
    one, a subdirectory (outside the fingerprint's files) or a link out would read any safetensors file the user
    can read. One line (exit 2), before a weight is loaded."""
    import shutil

    from llmcluster.checkpoint.nf4_base import weight_map
    from llmcluster.errors import UserError

    base = shutil.copytree(hf["model"], tmp_path / "base")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(next(base.glob("model-*.safetensors")), outside)
    if entry == "LINK":
        (base / "linked.safetensors").symlink_to(outside)
        entry = "linked.safetensors"
    entry = str(outside) if entry == "ABS" else entry
    index = json.loads((base / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: entry for k in index["weight_map"]}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match="outside"):
        weight_map(base)
    p = cli_inprocess(capsys, "train", "--root", hf["root"], "--resume", "never",
                      *job(base, "idx-out", "train.steps=1"))
    assert_one_line_error(p, "model.safetensors.index.json: weight_map entry")


def test_the_index_is_in_the_base_fingerprint_and_old_checkpoints_still_compare(hf, tmp_path):
    """The index's sha256 is a fingerprint field of its own (which hashed file each weight is read from); a
    checkpoint written before it existed has no such field and is not compared on it."""
    import shutil

    from llmcluster.checkpoint.fingerprint import base_index_sha256, check_fingerprint
    from llmcluster.errors import UserError

    base = shutil.copytree(hf["model"], tmp_path / "base")
    before = base_index_sha256(base)
    index = base / "model.safetensors.index.json"
    index.write_text(index.read_text() + "\n")
    now = {"n_layers": 2, "base_index": base_index_sha256(base)}
    assert now["base_index"] != before and len(before) == 16
    assert check_fingerprint(base, {"fingerprint": {"n_layers": 2}}, now, "r") is None     # older: not compared
    with pytest.raises(UserError, match="model.safetensors.index.json sha256"):
        check_fingerprint(base, {"fingerprint": {"n_layers": 2, "base_index": before}}, now, "r")
    index.unlink()
    assert base_index_sha256(base) == "none"
