"""The mesh arithmetic (no processes): degrees resolve against the world size, or fail in one line."""

from __future__ import annotations

import pytest

from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError
from llmcluster.train.distributed import ParallelDims


def dims(world: int, **parallel) -> ParallelDims:
    return ParallelDims.from_config(JobConfig(parallel=parallel), world)


@pytest.mark.parametrize("parallel, world, expect", [
    ({"dp_shard": -1}, 8, (1, 8, 1, "FSDP")),
    ({"dp_shard": -1}, 1, (1, 1, 1, "FSDP")),            # one GPU still gets FSDP's bf16 policy
    ({"dp_replicate": -1, "dp_shard": 1}, 4, (4, 1, 1, "DDP")),
    ({"dp_replicate": 2, "dp_shard": -1}, 8, (2, 4, 1, "HSDP")),
    ({"dp_shard": -1, "tp": 4}, 32, (1, 8, 4, "FSDP")),
    ({"dp_replicate": 1, "dp_shard": 1, "tp": 2}, 2, (1, 1, 2, "single")),
    ({"dp_replicate": 1, "dp_shard": 1}, 1, (1, 1, 1, "single")),
])
def test_degrees_resolve(parallel, world, expect):
    d = dims(world, **parallel)
    r, s, t, kind = expect
    assert (d.dp_replicate, d.dp_shard, d.tp) == (r, s, t)
    assert d.dp_replicate * d.dp_shard * d.tp == world and d.dp == r * s
    assert d.describe().startswith(kind)
    assert d.ddp == (kind == "DDP") and d.fsdp == (kind in ("FSDP", "HSDP"))
    # Consecutive ranks share a TP group: the data-parallel rank of rank k is k // tp.
    assert [d.dp_rank(k) for k in range(world)] == [k // t for k in range(world)]


@pytest.mark.parametrize("parallel, world, needle", [
    ({"dp_shard": 2, "tp": 2}, 2, "does not divide the world size 2"),
    ({"dp_replicate": 2, "dp_shard": 1}, 4, "but the world size is 4"),
    ({"dp_shard": -1, "tp": 2}, 3, "does not divide the world size 3"),
    ({"dp_replicate": -1, "dp_shard": 1, "tp": 2}, 4, "plain replication is not supported"),
])
def test_impossible_degrees_are_user_errors(parallel, world, needle):
    with pytest.raises(UserError, match=needle) as e:
        dims(world, **parallel)
    assert "\n" not in str(e.value)
