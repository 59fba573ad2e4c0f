"""The trainer builds its model on the meta device and gives memory only to each rank's shards (a 70B model
never exists whole in one process). Real torchrun processes (gloo, CPU): at FSDP, TP and FSDP×TP, with and
without tied embeddings, every rank's weights equal the single-process build bit for bit, and a rank holds
only its share of the elements."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, cli_env

pytestmark = pytest.mark.slow

SHAPE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=128", "model.vocab_size=320", "train.precision=fp32", "run.seed=7"]
MESHES = {  # name: (ranks, overrides, the largest share of all elements one rank may hold)
    "fsdp": (2, ["parallel.dp_shard=2", "parallel.dp_replicate=1"], 0.55),
    "tp": (2, ["parallel.tp=2", "parallel.dp_shard=1", "parallel.dp_replicate=1"], 0.55),
    "fsdp_tp": (4, ["parallel.tp=2", "parallel.dp_shard=2", "parallel.dp_replicate=1"], 0.30),
}


@pytest.fixture(scope="module")
def builds():
    """One torchrun launch per mesh builds the model untied and tied (meta_init_worker.py); each rank's JSON
    lines by mesh, made once per module."""
    made: dict[str, list[dict]] = {}

    def of(mesh: str) -> list[dict]:
        if mesh not in made:
            nproc, overrides, _ = MESHES[mesh]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   str(REPO / "tests" / "meta_init_worker.py"), *SHAPE, *overrides]
            proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
            # ranks share one stdout: their lines can interleave, so pick the JSON objects out of the stream
            made[mesh] = [json.loads(m) for m in re.findall(r"\{[^{}]*\}", proc.stdout)]
        return made[mesh]
    return of


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_build_equals_single_process_build(builds, mesh, tie):
    nproc, _, share = MESHES[mesh]
    ranks = [r for r in builds(mesh) if r["tied"] is tie]
    assert sorted(r["rank"] for r in ranks) == list(range(nproc)), builds(mesh)
    for r in ranks:
        assert r["max_abs_diff"] == 0.0, r
        assert r["local_numel"] <= share * r["total_numel"], r
