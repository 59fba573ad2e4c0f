"""Refusals that arguments and storage decide come before torch (issue 69): each command below, in a process of its
own, prints one `llmcluster CMD: error:` line, exits 2, and ends without torch in sys.modules (torch's import alone
is ~3.5 CPU-s on a 2-core AVX2 machine; these refusals take ~0.3-0.5). Each one's CPU seconds are printed (`-s`)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from conftest import cli_env

# sys.modules read at exit, whatever way the command leaves (SystemExit from the CLI's error path)
PROBE = ("import atexit, runpy, sys\n"
         "atexit.register(lambda: print('TORCH LOADED' if 'torch' in sys.modules else 'no torch', file=sys.stderr))\n"
         "sys.argv = ['llmcluster', *sys.argv[1:]]\n"
         "runpy.run_module('llmcluster', run_name='__main__')\n")


def _refusals(tmp_path):
    root = tmp_path / "storage"
    blocked = tmp_path / "a-file"        # a storage root that cannot be made (root is not stopped by modes)
    blocked.write_text("")
    return {
        "export, no such run": (["export", "--run", "nosuchrun", "--root", root], "has no complete checkpoint"),
        "export, no such step": (["export", "--run", "nosuchrun", "--step", "5", "--root", root],
                                 "no such checkpoint"),
        "generate, no such model": (["generate", "--model", "nosuch", "--prompt", "x", "--root", root],
                                    "no exported model"),
        "eval, no such model": (["eval", "--model", "nosuch", "--root", root], "no exported model"),
        "bench, storage not writable": (["bench", "-c", "llm_tiny", "--root", blocked / "storage"],
                                        "storage is not writable"),
        "train, storage not writable": (["train", "-c", "llm_tiny", "--root", blocked / "storage"],
                                        "storage is not writable"),
    }


@pytest.mark.parametrize("case", ["export, no such run", "export, no such step", "generate, no such model",
                                  "eval, no such model", "bench, storage not writable",
                                  "train, storage not writable"])
def test_a_refusal_decided_by_arguments_and_storage_comes_before_torch(tmp_path, case):
    argv, needle = _refusals(tmp_path)[case]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "-c", PROBE, *map(str, argv)], env=cli_env(), capture_output=True,
                       text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr[-2000:]
    assert lines[-1] == "no torch", p.stderr[-2000:]
    errors = [ln for ln in lines if ln.startswith(f"llmcluster {argv[0]}: error: ")]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in p.stderr, p.stderr[-2000:]
    print(f"{case}: {cpu:.2f} CPU-s")


def test_importing_torchao_for_the_nf4_base_and_low_bit_adamw_is_quiet():
    """Issue 69: on a CPU torchao's CUDA extensions fail to load and torch warns about its pytree registration,
    before the tool's first line on the QLoRA path: silenced for the import (llmcluster/quiet.py)."""
    pytest.importorskip("torchao")
    code = ("from llmcluster.checkpoint.nf4_base import nf4_module\nnf4_module()\n"
            "from llmcluster.config.schema import TrainConfig\nfrom llmcluster.train.optimizer import low_bit_adamw\n"
            "import torch\nlow_bit_adamw([{'params': [torch.nn.Parameter(torch.zeros(256, 256))]}], "
            "TrainConfig(optimizer='adamw8bit'))\nprint('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
    assert "Failed to load" not in p.stderr and "_pytree" not in p.stderr, p.stderr[-2000:]
