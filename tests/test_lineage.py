"""A model's record (issue 67): every export holds lineage.json (export files -> checkpoint -> run -> datasets -> base)
and a model card (README.md, Hugging Face's format) made from the run's records; `llmcluster lineage --verify`
recomputes every digest and names the first link that no longer holds in one line, exit 1.

One LoRA run from a small HF base (3 steps), exported once for the module; each tampering test changes one file and
puts it back."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import assert_one_line_error, cli_env, cli_inprocess, run_cli
from hf_helpers import make_hf_storage
from test_hf_import import LORA, job

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("transformers")
RUN = "lineage-lora"
STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from llmcluster.storage import eval_log

    base = tmp_path_factory.mktemp("lineage")
    hf = make_hf_storage(base)
    root = hf["root"]
    run_cli("train", "--root", root, "--resume", "never", *job(hf["model"], RUN, f"train.steps={STEPS}", LORA),
            check=True)
    # an evaluation of the step exported, as `llmcluster eval` records it (its shape: storage/eval_log.py)
    eval_log.append(root / "logs" / RUN, {
        "time": "2026-01-01T00:00:00Z", "run": RUN, "step": STEPS, "tokens": None, "dataset_digest": None,
        "model": str(root / "models" / RUN), "endpoint": None, "backend": "hf",
        "tasks": {"hellaswag": {"metrics": {"acc": 0.25, "acc_norm": 0.5}, "stderr": {"acc": 0.01}, "n": 10}}})
    run_cli("export", "--run", RUN, "--root", root, check=True)
    return SimpleNamespace(root=root, base=hf["model"], export=root / "models" / RUN)


@contextlib.contextmanager
def changed(path: Path):
    """`path` with one byte flipped (its size and mtime kept: only a digest can tell), put back after."""
    data = path.read_bytes()
    st = path.stat()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    try:
        yield
    finally:
        path.write_bytes(data)
        import os
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def lineage(capsys, model, *args):
    return cli_inprocess(capsys, "lineage", RUN, "--root", model.root, *args)


def test_the_export_holds_its_lineage_and_verify_passes(capsys, model):
    t0 = time.monotonic()
    proc = lineage(capsys, model, "--verify")
    assert proc.returncode == 0, proc.stderr
    for link in ("export: verified", f"checkpoint {RUN} step_{STEPS}: verified", f"run {RUN}: verified",
                 "dataset corpus: verified", f"base {model.base.resolve()}: verified"):
        assert link in proc.stdout, (link, proc.stdout)
    print(f"lineage --verify: {time.monotonic() - t0:.2f} s")
    rec = json.loads(cli_inprocess(capsys, "lineage", str(model.export), "--json").stdout)["lineage"]
    assert rec["checkpoint"]["step"] == STEPS and rec["checkpoint"]["path"] == f"checkpoints/{RUN}/step_{STEPS}"
    assert {"model.safetensors", "config.json", "llmcluster.json", "adapter/adapter_model.safetensors"} \
        <= set(rec["export"]["files"])
    assert "README.md" not in rec["export"]["files"] and "lineage.json" not in rec["export"]["files"]
    assert rec["run"]["attempts"] == 1 and rec["run"]["lora"]["rank"] == 4
    assert rec["base"]["files"].keys() == {p.name for p in model.base.iterdir() if p.is_file()}


@pytest.mark.parametrize("what", ["dataset shard", "checkpoint file", "export file", "base file"])
def test_a_changed_file_names_its_link(capsys, model, what):
    """One change at a time, each named in one line with exit 1; put back, the chain verifies again."""
    ds = model.root / "datasets" / "text" / "corpus"
    path, link = {
        "dataset shard": (sorted(ds.glob("train_*.bin"))[0], "dataset corpus"),
        "checkpoint file": (model.root / "checkpoints" / RUN / f"step_{STEPS}" / "train_state.json",
                            f"checkpoint {RUN} step_{STEPS}"),
        "export file": (model.export / "config.json", "export"),
        "base file": (model.base / "config.json", "base"),
    }[what]
    with changed(path):
        proc = lineage(capsys, model, "--verify")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"llmcluster lineage: broken at {link}") and path.name in lines[0], lines[0]
    assert lineage(capsys, model, "--verify").returncode == 0


def test_a_file_added_to_the_export_breaks_it(capsys, model):
    extra = model.export / "extra.bin"
    extra.write_bytes(b"x")
    try:
        proc = lineage(capsys, model, "--verify")
    finally:
        extra.unlink()
    assert proc.returncode == 1 and "broken at export" in proc.stderr and "extra.bin" in proc.stderr


@pytest.mark.parametrize("text, needle", [("{", "is not JSON"), ("[]", "not a JSON object"),
                                          ('{"format": "llmcluster-lineage-v1"}', "export")])
def test_a_malformed_record_is_one_line(capsys, model, text, needle):
    path = model.export / "lineage.json"
    saved = path.read_bytes()
    path.write_text(text)
    try:
        proc = lineage(capsys, model, "--verify")
    finally:
        path.write_bytes(saved)
    assert_one_line_error(proc, "lineage.json", needle)


def test_the_card_parses_and_says_what_the_records_say(model):
    from huggingface_hub import ModelCard

    card = ModelCard.load(model.export / "README.md")
    data = card.data.to_dict()
    state = json.loads((model.root / "checkpoints" / RUN / f"step_{STEPS}" / "train_state.json").read_text())
    rec = json.loads((model.export / "lineage.json").read_text())
    ours = data["llmcluster"]
    assert data["license"] == "other" and "base_model" not in data   # a local base: no Hub id
    assert ours["training"]["steps"] == STEPS == state["step"]
    assert ours["training"]["tokens_seen"] == state["sampler"]["consumed"] * state["config"]["data"]["seq_len"]
    assert ours["training"]["lora"] == state["config"]["train"]["lora"]
    assert ours["training"]["precision"] == "fp32"
    meta = json.loads((model.root / "datasets" / "text" / "corpus" / "meta.json").read_text())
    assert [(d["name"], d["tokens"]) for d in ours["datasets"]] == [("corpus", meta["tokens"])]
    assert ours["datasets"][0]["meta_sha256"] == rec["datasets"][0]["meta_sha256"]
    assert ours["base"]["path"] == str(model.base.resolve()) and ours["adapter"] == "adapter/"
    assert f"`{model.base.resolve()}`" in card.text and "Adapter: `adapter/`" in card.text
    from llmcluster.export.lineage import base_digest
    assert ours["base"]["sha256"] == rec["base"]["sha256"] == base_digest(rec["base"]["files"])
    c = ours["compute"]
    assert c["train_flops"] == c["flops_per_token"] * ours["training"]["tokens_seen"] > 0
    assert c["device"] == state["device"] == "cpu" and c["device_hours"] == rec["run"]["wall_s"] / 3600 > 0
    assert c["energy_kwh_measured"] is None and c["energy_kwh_estimate"] is None
    assert "not estimated: trained on cpu" in c["energy_note"]
    assert ours["software"]["llmcluster"]
    from llmcluster.storage.layout import sha256_file
    assert ours["lineage_sha256"] == sha256_file(model.export / "lineage.json")
    scores = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert scores == {("hellaswag", "acc"): 0.25, ("hellaswag", "acc_norm"): 0.5}
    assert card.text.count("**To be written**") == 3


def test_lineage_without_an_export_is_one_line(capsys, model, tmp_path):
    assert_one_line_error(cli_inprocess(capsys, "lineage", "nosuchrun", "--root", model.root), "no exported model")


# An auditor's machine (docs/lineage.md): none of the training stack can be imported (any attempt raises ImportError)
NO_TORCH = ("import sys\n"
            "class NoTorch:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in {'torch', 'numpy', 'safetensors', 'tokenizers', 'transformers',\n"
            "                                  'huggingface_hub', 'rich'}:\n"
            "            raise ImportError(f'no {name} on this machine')\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "import runpy\n"
            "sys.argv = ['llmcluster', *sys.argv[1:]]\n"
            "runpy.run_module('llmcluster', run_name='__main__')\n")


def test_verify_runs_where_torch_and_numpy_cannot_be_imported(model):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", NO_TORCH, "lineage", RUN, "--root", str(model.root), "--verify"],
                       env=cli_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "every link that could be reached holds (5 verified)" in p.stdout, p.stdout
    print(f"lineage --verify without torch: {time.monotonic() - t0:.2f} s")


def test_a_dataset_rebuilt_between_training_and_export_is_said_and_breaks_the_chain(capsys, model, tmp_path):
    """The export records the data as it is then; the run's train state says what it trained on: both said."""
    import shutil

    root = tmp_path / "storage"
    shutil.copytree(model.root, root, ignore=shutil.ignore_patterns("models"))
    meta = root / "datasets" / "text" / "corpus" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "created": "later"}, indent=2))
    proc = run_cli("export", "--run", RUN, "--root", root, check=True)
    assert "not the data the run trained on" in proc.stderr, proc.stderr
    proc = cli_inprocess(capsys, "lineage", RUN, "--root", root, "--verify")
    assert proc.returncode == 1 and "broken at dataset corpus: not the data the run trained on" in proc.stderr, \
        proc.stderr


def test_energy_on_a_gpu_of_the_planners_table_is_its_estimate_and_says_so():
    from llmcluster.config.gpus import GPUS
    from llmcluster.export.card import energy
    from llmcluster.plan.tables import hardware

    out = energy({"device": "NVIDIA H100 80GB HBM3", "world_size": 8, "wall_s": 1800.0})
    h100 = GPUS["H100"]
    assert out["device_hours"] == 4.0 and out["energy_kwh_measured"] is None
    assert out["energy_kwh_estimate"] == pytest.approx(
        4.0 * h100.server_power_factor * h100.power_w / 1000 * hardware()["training_load"])
    assert out["energy_note"].startswith("an ESTIMATE, not a measurement")
    assert energy({"device": "NVIDIA Unknown 9000", "world_size": 1, "wall_s": 1.0})["energy_kwh_estimate"] is None


# -- serving: the record's digest, --require-lineage, and the endpoint as the chain's first link ------------------
def serve_dry_run(model, *extra):
    digest = "vllm/vllm-openai:v0.11.0@sha256:" + "b" * 64
    return run_cli("serve", "start", "--model", RUN, "--root", model.root, "--scheduler", "k8s", "--cluster",
                   "rtx4090-box", "--namespace", "ml", "--image", digest, "--set", "job.mem_per_node=64G",
                   "--dry-run", *extra)


def test_serve_start_require_lineage_refuses_a_broken_chain(model):
    ok = serve_dry_run(model, "--require-lineage")
    assert ok.returncode == 0, ok.stderr[-2000:]
    with changed(model.export / "adapter" / "adapter_model.safetensors"):
        proc = serve_dry_run(model, "--require-lineage")
    assert_one_line_error(proc, "--require-lineage", "broken at export", "adapter_model.safetensors")


def test_the_serving_record_names_the_lineage_and_lineage_starts_at_the_endpoint(capsys, model):
    """`serve start` puts what export/lineage.served gives into job.json (a record written here as it writes it:
    no engine runs in this test); `lineage ENDPOINT --verify` checks that digest first."""
    from llmcluster.export.lineage import served
    from llmcluster.storage.job_record import write_record

    fields = served(model.export, require=True)
    assert fields == {"lineage_sha256": json.loads(cli_inprocess(capsys, "lineage", RUN, "--root", model.root,
                                                                 "--json").stdout)["lineage_sha256"],
                      "lineage_verified": True}
    logs = model.root / "logs" / "serve-lin"
    logs.mkdir(parents=True, exist_ok=True)
    job = {"run": "serve-lin", "kind": "serve", "scheduler": "local", "model": RUN,
           "model_dir": str(model.base.resolve()), "adapter": str(model.export / "adapter"), **fields}
    write_record(logs, job)
    proc = cli_inprocess(capsys, "lineage", "serve-lin", "--root", model.root, "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "endpoint serve-lin: verified" in proc.stdout and f"base {model.base.resolve()}: verified" in proc.stdout
    write_record(logs, {**job, "lineage_sha256": "0" * 64})   # another export's digest
    proc = cli_inprocess(capsys, "lineage", "serve-lin", "--root", model.root, "--verify")
    assert proc.returncode == 1 and proc.stderr.startswith("llmcluster lineage: broken at endpoint serve-lin"), \
        proc.stderr


def test_an_eval_after_the_export_reaches_the_cards_model_index_and_keeps_what_a_person_wrote(capsys, model):
    """What `llmcluster eval` of an export calls once its record is appended (eval/evaluate.py refresh_card)."""
    from huggingface_hub import ModelCard

    from llmcluster.export.card import TO_BE_WRITTEN, refresh_evals
    from llmcluster.storage import eval_log

    card_file, log = model.export / "README.md", model.root / "logs" / RUN / "eval.jsonl"
    saved_card, saved_log = card_file.read_bytes(), log.read_bytes()
    try:
        card_file.write_text(card_file.read_text().replace(TO_BE_WRITTEN, "Internal code completion only.", 1))
        eval_log.append(model.root / "logs" / RUN, {
            "run": RUN, "step": STEPS, "endpoint": None, "backend": "hf",
            "tasks": {"llmc_stdlib_mc": {"metrics": {"acc": 0.75}, "stderr": {}}}})
        assert refresh_evals(model.export, model.root)
        card = ModelCard.load(card_file)
        scores = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
        assert scores == {("hellaswag", "acc"): 0.25, ("hellaswag", "acc_norm"): 0.5, ("llmc_stdlib_mc", "acc"): 0.75}
        assert "Internal code completion only." in card.text and card.text.count("**To be written**") == 2
        assert card.data.to_dict()["llmcluster"]["run"] == RUN
        assert lineage(capsys, model, "--verify").returncode == 0   # the card is not among the hashed files
    finally:
        card_file.write_bytes(saved_card)
        log.write_bytes(saved_log)


def test_unreachable_links_are_said_and_an_nf4_base_is_checked_against_the_fingerprint(capsys, tmp_path):
    """No training: a record made here. The checkpoint and dataset are on another machine (not reachable: said,
    exit 0); the base is here, and a QLoRA run's fingerprint names its weights' digest, which must be the base's."""
    from llmcluster.checkpoint.fingerprint import base_weights_sha256
    from llmcluster.export.lineage import LINEAGE_FORMAT, base_digest, digests

    export, base = tmp_path / "models" / "q", tmp_path / "base"
    export.mkdir(parents=True)
    base.mkdir()
    (export / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"weights")
    (base / "config.json").write_text("{}")
    files = digests(base)
    sha = "a" * 64
    rec = {"format": LINEAGE_FORMAT, "export": {"files": digests(export)},
           "checkpoint": {"run": "q", "step": 5, "path": "checkpoints/q/step_5", "complete_sha256": sha},
           "run": {"name": "q", "config_sha256": sha, "fingerprint": {"base_weights": base_weights_sha256(base)}},
           "datasets": [{"name": "d", "path": "datasets/text/d", "meta_sha256": sha, "tokenizer_sha256": sha,
                         "shards": {}}],
           "base": {"path": str(base), "sha256": base_digest(files), "files": files}}
    (export / "lineage.json").write_text(json.dumps(rec))
    proc = cli_inprocess(capsys, "lineage", str(export), "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint q step_5: not reachable here" in proc.stdout and "dataset d: not reachable here" in proc.stdout
    assert f"base {base}: verified" in proc.stdout and "(2 verified, 3 not reachable here)" in proc.stdout
    rec["run"]["fingerprint"]["base_weights"] = "0" * 16     # the run quantized other weights than these
    (export / "lineage.json").write_text(json.dumps(rec))
    proc = cli_inprocess(capsys, "lineage", str(export), "--verify")
    assert proc.returncode == 1 and f"broken at base {base}: its weights are not those the run trained on" in \
        proc.stderr, proc.stderr


def test_an_unreadable_dataset_record_refuses_the_export_and_a_missing_base_is_said(capsys, model, tmp_path):
    """The export records every dataset the run read or is not written (one line); a LoRA run's base gone since
    training (its checkpoint holds every weight) is exported, the gap said, and --verify says it is not reachable."""
    import shutil

    root = tmp_path / "storage"
    shutil.copytree(model.root, root, ignore=shutil.ignore_patterns("models"))
    meta = root / "datasets" / "text" / "corpus" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "shards": {"train": [{"file": 1}]}}))
    assert_one_line_error(run_cli("export", "--run", RUN, "--root", root, "--out", tmp_path / "x"),
                          "cannot record the lineage: dataset corpus")
    assert not (tmp_path / "x").exists()

    aside = model.base.with_name("llama-aside")
    model.base.rename(aside)
    try:
        proc = run_cli("export", "--run", RUN, "--root", model.root, "--out", tmp_path / "y", check=True)
        assert "train.init_from" in proc.stderr and "is not here" in proc.stderr
        proc = cli_inprocess(capsys, "lineage", str(tmp_path / "y"), "--root", model.root, "--verify")
    finally:
        aside.rename(model.base)
    assert proc.returncode == 0 and f"base {model.base.resolve()}: not reachable here" in proc.stdout, proc.stdout


def test_a_large_file_is_hashed_with_progress(tmp_path, monkeypatch):
    """A base of many GB takes minutes to hash: --verify (and the export) say how far they are every few seconds."""
    import hashlib

    from llmcluster.export import lineage as lin

    big = tmp_path / "model-00001.safetensors"
    big.write_bytes(b"x" * (3 << 22))          # three 4 MiB reads
    monkeypatch.setattr(lin, "PROGRESS_BYTES", 1 << 20)
    clock = iter(range(0, 1000, 6))             # each look at the clock is 6 s later
    monkeypatch.setattr(lin.time, "monotonic", lambda: next(clock))
    said = []
    assert lin.hash_file(big, said.append) == hashlib.sha256(big.read_bytes()).hexdigest()
    assert said and said[0].startswith(f"hashing {big}: 33% of 0.0 GB") and said[-1].endswith("100% of 0.0 GB")
