"""Fit before launch (plan/fit.py): the job config's memory per GPU from the planner, and `launch` refusing
a job that will not fit in one line unless --force. GPUs are named, never present (no GPU here)."""

from __future__ import annotations

from conftest import assert_one_line_error, run_cli

from llmcluster.config.load import load_job_config
from llmcluster.plan.fit import job_fit, job_plan

GIB = 1024**3


def test_the_job_plan_is_the_trainers_layout():
    cfg = load_job_config("llm_70b", ["job.nodes=8", "job.gpus_per_node=4"])
    plan = job_plan(cfg, "A100-80GB")
    assert (plan.world, plan.parallel.tp, plan.dp_degrees) == (32, 4, (1, 8))
    assert plan.zero_stage == 3 and plan.parallel.activation_checkpoint == "full"
    assert plan.micro_batches == cfg.train.grad_accum


def test_auto_checkpointing_is_fitted_as_full_the_most_the_trainer_can_save():
    """`launch` must not refuse a job that the trainer's auto choice (at most full, train/resources.py) fits."""
    sets = ["job.nodes=8", "job.gpus_per_node=4", "train.micro_batch=4", "train.grad_accum=4"]
    auto = job_fit(load_job_config("llm_70b", sets + ["parallel.activation_checkpoint=auto"]), "A100-80GB")
    full = job_fit(load_job_config("llm_70b", sets + ["parallel.activation_checkpoint=full"]), "A100-80GB")
    none = job_fit(load_job_config("llm_70b", sets + ["parallel.activation_checkpoint=none"]), "A100-80GB")
    assert auto.needed_bytes == full.needed_bytes < none.needed_bytes


def test_a_job_that_fits_and_one_that_does_not_with_the_best_alternative():
    fits = job_fit(load_job_config("llm_70b", ["job.nodes=8", "job.gpus_per_node=4"]), "A100-80GB")
    assert fits.fits and fits.alternative is None and "fits" in fits.line()
    big = load_job_config("llm_70b", ["job.nodes=8", "job.gpus_per_node=4", "parallel.activation_checkpoint=none",
                                      "train.micro_batch=4", "train.grad_accum=4"])
    fit = job_fit(big, "A100-80GB")
    assert not fit.fits and fit.needed_bytes > fit.available_bytes == 80e9
    alt = fit.alternative
    assert alt["memory_bytes"] <= 80e9 and alt["global_batch"] == 4 * 4 * 8  # the same global batch
    assert all(f"--set {o}" in fit.line() for o in alt["set"])
    # a smaller GPU memory (a MIG slice, say) is honoured
    assert not job_fit(load_job_config("llm_7b", ["job.nodes=1", "job.gpus_per_node=4"]), "A100-80GB",
                       gpu_memory_bytes=8 * GIB).fits


def test_launch_refuses_in_one_line_unless_forced(tmp_path):
    args = ["launch", "--config", "llm_70b", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "4",
            "--gpu", "A100-80GB", "--dry-run", "--root", tmp_path / "s"]
    assert_one_line_error(run_cli(*args), "will not fit", "GiB per GPU", "74.5 GiB available", "--force")
    forced = run_cli(*args, "--force")
    assert forced.returncode == 0 and "#SBATCH" in forced.stdout, forced.stderr
    ok = run_cli(*args[:6], "8", *args[7:])  # 8 nodes: 32 GPUs hold it
    assert ok.returncode == 0 and "#SBATCH" in ok.stdout, ok.stderr


def test_emit_config_for_a_model_the_trainer_cannot_run_is_a_one_line_error(tmp_path):
    from conftest import REPO

    out = tmp_path / "job.yaml"
    proc = run_cli("plan", REPO / "plans" / "bloom-176b.yaml", "--emit-config", out)
    assert_one_line_error(proc, "no layout the trainer can run", "bloom-176b")  # GeLU, ZeRO-1, tied, ...
    assert not out.exists()
