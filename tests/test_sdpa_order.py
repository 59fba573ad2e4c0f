"""SDPA's backend order (train/attention.py, issue 36): cuDNN → Flash → Efficient → Math where torch's own
dispatcher prefers cuDNN (sm90/sm10x, cuDNN > 9.15.0), else cuDNN last; set around every forward and backward
by `step_context`; the kernel chosen said once at start. No GPU here: the order itself is pure, the context is
observed through torch's priority list, and on CPU (where the order does not apply) the loss and gradients
must be exactly what they are without it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import cli_inprocess, overrides, run_cli
from llmcluster.config.schema import ModelConfig
from llmcluster.model.llama import build_model
from llmcluster.train.attention import backend_order, priority_supported, sdpa_priority

CUDNN_FIRST = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
CUDNN_LAST = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION"]


@pytest.mark.parametrize("capability, cudnn, deprioritized, expected", [
    ((9, 0), 91501, False, CUDNN_FIRST),     # H100/H200 with the cuDNN whose seq % 128 fix torch waits for
    ((10, 0), 91600, False, CUDNN_FIRST),    # B200
    ((9, 0), 91002, False, CUDNN_LAST),      # older cuDNN (CUDA <= 12.9 wheels): torch keeps cuDNN last
    ((8, 0), 91501, False, CUDNN_LAST),      # A100: torch never prefers cuDNN there
    ((9, 0), 91501, True, CUDNN_LAST),       # TORCH_CUDNN_SDPA_DEPRIORITIZED honoured
    (None, None, False, None),               # CPU: no order
])
def test_the_backend_order_follows_torchs_own_cudnn_rule(capability, cudnn, deprioritized, expected):
    assert backend_order(capability, cudnn, deprioritized) == expected


@pytest.mark.skipif(not priority_supported(), reason="this torch's sdpa_kernel has no set_priority")
def test_the_context_sets_the_priority_and_restores_torchs():
    before = torch._C._get_sdp_priority_order()
    with sdpa_priority(CUDNN_FIRST):
        inside = torch._C._get_sdp_priority_order()
    from torch.nn.attention import SDPBackend
    assert inside[:4] == [int(getattr(SDPBackend, n)) for n in CUDNN_FIRST]
    assert torch._C._get_sdp_priority_order() == before


@pytest.mark.parametrize("doc_mask", [None, 0], ids=["causal GQA", "document mask"])
def test_the_loss_and_gradients_are_unchanged_under_the_order(doc_mask):
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=97,
                      max_seq_len=32, doc_mask_id=doc_mask)
    tokens = torch.randint(1, 97, (2, 17), generator=torch.Generator().manual_seed(0))
    tokens[:, 7] = 0

    def run(context):
        model = build_model(cfg, seed=3)
        with context:
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    plain_loss, plain_grads = run(contextlib.nullcontext())
    loss, grads = run(sdpa_priority(CUDNN_FIRST))
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_bench_says_the_kernel_once_at_start(tmp_path, capsys):
    run_cli("storage", "init", "--root", tmp_path / "s", check=True)
    ok = cli_inprocess(capsys, "bench", "--config", "llm_tiny", "--root", tmp_path / "s", "--steps", "1",
                       "--warmup", "0", *overrides("model.n_layers=1", "train.micro_batch=1", "run.name=sdpa"))
    assert ok.returncode == 0, ok.stderr
    lines = [ln for ln in ok.stdout.splitlines() if ln.startswith("attention: SDPA ")]
    assert len(lines) == 1 and " on CPU (" in lines[0], ok.stdout
