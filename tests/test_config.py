"""Config: presets, typed overrides, and one-line errors (exit 2) for every kind of bad input."""

from pathlib import Path

import pytest

from conftest import assert_one_line_error, cli_inprocess, run_cli
from llmcluster.config import load_job_config
from llmcluster.errors import UserError

PRESETS = ["llm_tiny", "llm_125m", "llm_1b", "llm_7b", "llm_13b", "llm_70b"]
FINETUNE_PRESETS = ["llm_8b_qlora", "llm_70b_qlora"]     # QLoRA: the base is the user's, named by train.init_from


def test_every_shipped_preset_is_listed_here():
    from llmcluster.paths import shipped_names

    assert sorted(shipped_names("configs")) == sorted(PRESETS + FINETUNE_PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_presets_validate(name):
    cfg = load_job_config(name)
    assert cfg.model.d_model % cfg.model.n_heads == 0


@pytest.mark.parametrize("name", FINETUNE_PRESETS)
def test_finetune_presets_name_their_base_or_say_how_in_one_line(name, tmp_path):
    with pytest.raises(UserError, match=r"needs train.init_from .*--set train.init_from=DIR"):
        load_job_config(name)
    cfg = load_job_config(name, [f"train.init_from={tmp_path}"])
    assert cfg.train.lora.base_precision == "nf4" and cfg.model.d_model % cfg.model.n_heads == 0


def test_llm_7b_has_llama2_7b_parameter_count():
    from llmcluster.model import param_count
    from llmcluster.model.llama import build_model

    cfg = load_job_config("llm_7b").model
    model = build_model(cfg, device="meta")  # shapes only: no 27 GB allocation
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616 == param_count(cfg)


def test_llm_70b_is_gqa_with_8_kv_heads():
    from llmcluster.model import param_count

    cfg = load_job_config("llm_70b").model
    assert cfg.kv_heads == 8 and 68e9 < param_count(cfg) < 70e9


def test_overrides_are_typed_and_dotted():
    cfg = load_job_config("llm_tiny", ["train.lr=3e-4", "train.steps=7", "train.compile=true",
                                       "run.name=abc", "checkpoint.async=true"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 7 and cfg.train.compile is True
    assert cfg.run.name == "abc" and cfg.checkpoint.async_save is True


@pytest.mark.parametrize("override, needles", [
    ("train.lrr=1", ["unknown key 'train.lrr'", "did you mean 'train.lr'"]),
    ("trian.steps=1", ["unknown key 'trian'", "'train'"]),
    ("train.steps=abc", ["train.steps", "integer"]),
    ("train.precision=fp8", ["train.precision"]),
    ("model.n_kv_heads=4", ["model.n_kv_heads (4) must divide model.n_heads"]),
    ("model.n_heads=5", ["model.n_heads (5) must divide model.d_model"]),
    ("run.name=a b", ["invalid run name"]),
    ("run.name=../x", ["invalid run name"]),
    ("data.seq_len=100000", ["data.seq_len", "max_seq_len"]),
    ("parallel.dp_replicate=-1", ["only one of"]),  # llm_tiny already has dp_replicate=-1; dp_shard too:
    # durations are finite (issue 50): `sleep inf`, and timedelta overflowed on the timeouts
    ("ft.straggler_backoff_s=.inf", ["ft.straggler_backoff_s", "finite"]),
    ("ft.quorum_timeout_s=inf", ["ft.quorum_timeout_s", "finite"]),
    ("ft.join_timeout_s=1e400", ["ft.join_timeout_s", "finite"]),
    ("dist.timeout_s=.inf", ["dist.timeout_s", "finite"]),
    ("checkpoint.lock_stale_s=nan", ["checkpoint.lock_stale_s", "finite"]),
    ("checkpoint.grace_period_s=.nan", ["checkpoint.grace_period_s", "finite"]),
])
def test_bad_overrides_are_one_line_exit_2(capsys, override, needles):
    extra = ["--set", "parallel.dp_shard=-1"] if override.startswith("parallel.") else []
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--set", override, *extra)
    assert_one_line_error(proc, *needles)


def test_unknown_key_in_file_names_key_and_suggestion(tmp_path: Path):
    # A real subprocess once: the exit code and stderr are what a shell sees.
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  stpes: 10\n")
    assert_one_line_error(run_cli("train", "--config", f), "unknown key 'train.stpes'", "train.steps")


@pytest.mark.parametrize("text, needle", [
    ("train: [1, 2\n", "invalid YAML"),
    ("- just\n- a list\n", "mapping"),
    ("train:\n  steps: -3\n", "train.steps"),
    ("model:\n  vocab_size: 1.5\n", "model.vocab_size"),
])
def test_malformed_files(capsys, tmp_path: Path, text, needle):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    assert_one_line_error(cli_inprocess(capsys, "train", "--config", f), needle)


def test_missing_config_and_bad_override_syntax(capsys):
    assert_one_line_error(cli_inprocess(capsys, "train", "--config", "no_such_config"), "not found")
    assert_one_line_error(cli_inprocess(capsys, "train", "--config", "llm_tiny", "--set", "train.lr"),
                          "key.path=value")


def test_batch_not_divisible_by_data_parallel_degree(capsys, tiny_root):
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--root", tiny_root,
                         "--set", "train.global_batch=7")
    assert_one_line_error(proc, "train.global_batch (7)")


def test_sequence_parallel_is_on_by_default_and_accepted_at_any_tp(capsys):
    """Off means something only with tp > 1 and is accepted (and ignored) at tp = 1, so a config written for a
    Megatron-like TP run still runs with `--set parallel.tp=1`; off lifts the refusal of train.loss_chunks
    with TP (the head's input is then whole on every TP rank, not sharded on the sequence)."""
    assert load_job_config("llm_tiny").parallel.sequence_parallel is True
    assert load_job_config("llm_tiny", ["parallel.sequence_parallel=false"]).parallel.sequence_parallel is False
    cfg = load_job_config("llm_tiny", ["parallel.tp=2", "parallel.sequence_parallel=false", "train.loss_chunks=4"])
    assert cfg.parallel.tp == 2 and cfg.train.loss_chunks == 4
    proc = cli_inprocess(capsys, "train", "--config", "llm_tiny", "--set", "parallel.sequence_parallel=maybe")
    assert_one_line_error(proc, "parallel.sequence_parallel", "bool")


def test_mesh_degrees_must_match_world_size():
    with pytest.raises(UserError, match="world size"):
        from llmcluster.distributed.process_groups import ParallelDims

        ParallelDims.from_config(load_job_config("llm_tiny", ["parallel.dp_replicate=3"]), 2)


def test_help_lists_every_subcommand():
    out = run_cli("--help", check=True).stdout
    for cmd in ("storage", "data", "train", "bench", "export", "generate", "plan", "launch", "jobs",
                "validate", "monitor"):
        assert f"    {cmd}" in out, cmd
