"""`serve start --scheduler slurm` on the test Slurm (slurm_cluster.py): the sbatch script starts the real vLLM
(CPU build) on a node, waits for its /health inside the job and writes the endpoint; serve start reads it, sends
the smoke request and prints it; `jobs cancel` ends the job (and the server with it)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
from slurm_cluster import job_state, slurm, wait_for  # noqa: F401

from conftest import run_cli, vllm_python
from hf_helpers import make_hf_llama, make_hf_tokenizer

pytestmark = [pytest.mark.slurm, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_serving_job_becomes_healthy_answers_and_is_cancelled(slurm, tmp_path):
    python = vllm_python()
    root = tmp_path / "storage"
    run_cli("storage", "init", "--root", root, check=True)
    # a small random Llama (no training: this is about the job, test_serve_vllm checks the answers) with a head
    # dim the CPU engine runs
    model = make_hf_tokenizer(root / "models" / "rnd")
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    make_hf_llama(model, vocab=len(vocab) + 2, max_shard_size=None, num_attention_heads=2, num_key_value_heads=1)
    p = run_cli("serve", "start", "--model", "rnd", "--root", root, "--scheduler", "slurm", "--time", "15",
                "--engine-python", python, timeout=900)
    logs = root / "logs" / "serve-rnd"
    rec = json.loads((logs / "job.json").read_text())
    job = rec["job_id"]
    try:
        assert p.returncode == 0, (p.stdout, p.stderr, *(f.read_text()[-3000:] for f in logs.glob("slurm-*.out")))
        url = next(ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("endpoint "))
        assert rec["kind"] == "serve" and rec["scheduler"] == "slurm" and rec["endpoint"] == url
        assert job_state(job) == "RUNNING"
        assert (logs / f"endpoint-{job}").read_text().strip() + "/v1" == url    # written by the job itself
        body = json.dumps({"model": "rnd", "prompt": "the quick", "max_tokens": 5, "temperature": 0}).encode()
        key = (logs / "api_key").read_text().strip()      # the job read it from this 0600 file at run time
        req = urllib.request.Request(f"{url}/completions", data=body, headers={"Content-Type": "application/json",
                                                                              "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        st = json.loads(run_cli("jobs", "status", "serve-rnd", "--root", root, "--json", check=True).stdout)
        assert st["state"] == "RUNNING"
        assert "healthy" in run_cli("jobs", "logs", "serve-rnd", "--root", root, check=True).stdout
    finally:
        run_cli("jobs", "cancel", "serve-rnd", "--root", root, check=True)
    assert wait_for(job, ("CANCELLED",), timeout=60) == "CANCELLED"
    for _ in range(60):    # slurmstepd ends the job's processes: the server is gone
        left = subprocess.run(["pgrep", "-f", f"--model {root / 'models' / 'rnd'}"], capture_output=True,
                              text=True).stdout
        if not left.strip():
            break
        time.sleep(0.5)
    assert not left.strip(), f"the server of job {job} survived the cancel: {left}"
