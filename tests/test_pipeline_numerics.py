"""Pipeline parallelism where CPU runs used to differ from GPU ones: fp16 (a GradScaler) and the document mask.

Real processes (torchrun + gloo), the 4-layer Llama of test_pipeline.py, 4 steps: pp=2 on 2 ranks against one
process with the same global batch (4 micro-batches of 1).

fp16 on CPU: this CPU has no native fp16, so the trainer would compute in fp32; the test hook
LLMCLUSTER_TEST_FORCE_CPU_FP16 (active only with LLMCLUSTER_TESTING=1) keeps fp16 autocast and the GradScaler,
emulated, so the scaler's path under PP runs here as it will on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import repo_source_dataset
from test_parallel import losses, train
from test_pipeline import pp_mesh

pytestmark = pytest.mark.slow

STEPS = range(1, 5)
FP16 = {"LLMCLUSTER_TESTING": "1", "LLMCLUSTER_TEST_FORCE_CPU_FP16": "1"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return repo_source_dataset(tmp_path_factory.mktemp("ppn") / "s", 30)


def test_fp16_pp2_with_grad_scaler_matches_one_process(root):
    """On main step 1 died in `GradScaler.unscale_` (the loss was multiplied by get_scale(), never scaled)."""
    fp16 = ["--set", "train.precision=fp16", "--set", "train.stop_at=4"]
    one = train(root, "fp16_one", 1, *pp_mesh(1), *fp16, env=FP16)
    pp = train(root, "fp16_pp", 2, *pp_mesh(2), *fp16, env=FP16)
    for proc in (one, pp):
        assert "device cpu, fp16," in proc.stdout, proc.stdout  # really fp16, not demoted to fp32
        assert "LLMCLUSTER_TEST_FORCE_CPU_FP16=1 is active" in proc.stderr, proc.stderr
    ref, got = losses(root, "fp16_one"), losses(root, "fp16_pp")
    assert sorted(got) == sorted(ref) == list(STEPS), (ref, got)
    rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in STEPS}
    assert max(rel.values()) < 1e-3, rel


def test_pp2_with_document_mask_matches_one_process(root):
    """On main the stages ignored the mask: pp=2 differed from one process by ~7.6e-2 in loss. Token 198 (the
    byte tokenizer's newline) ends a 'document', so each line attends only to itself."""
    doc = ["--set", "model.doc_mask_id=198", "--set", "train.stop_at=4"]
    train(root, "doc_one", 1, *pp_mesh(1), *doc)
    train(root, "doc_pp", 2, *pp_mesh(2), *doc)
    train(root, "nodoc_one", 1, *pp_mesh(1), "--set", "train.stop_at=4")
    ref, got, plain = losses(root, "doc_one"), losses(root, "doc_pp"), losses(root, "nodoc_one")
    assert sorted(got) == sorted(ref) == list(STEPS), (ref, got)
    assert max(abs(got[s] - ref[s]) for s in STEPS) < 1e-4, (ref, got)
    assert max(abs(plain[s] - ref[s]) for s in STEPS) > 3e-3, (ref, plain)  # the mask does change the loss
