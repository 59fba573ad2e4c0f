"""The mesh arithmetic (no processes): degrees resolve against the world size, or fail in one line."""

from __future__ import annotations

import pytest

from llmcluster.config.schema import JobConfig
from llmcluster.errors import UserError
from llmcluster.distributed.process_groups import ParallelDims


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


def test_pipeline_is_the_outermost_dimension():
    d = ParallelDims.from_config(JobConfig(parallel={"dp_shard": -1, "tp": 2, "pp": 2},
                                           train={"grad_accum": 2}), 8)
    assert (d.pp, d.dp_shard, d.tp) == (2, 2, 2)
    # rank = ((pp · dp) + dp_rank) · tp + tp_rank
    assert [d.pp_rank(k) for k in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.dp_rank(k) for k in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert d.describe() == "FSDP dp_replicate=1 dp_shard=2 × TP 2 × PP 2 1F1B (world 8)"


@pytest.mark.parametrize("layers, stages, sizes", [
    (70, 12, [5] + [6] * 10 + [5]),   # BLOOM-176B: embedding + 5, 10 x 6, 5 + head
    (80, 4, [20, 20, 20, 20]),        # the remainder of 82 units goes to the ends
    (4, 4, [1, 1, 1, 1]),
    (5, 4, [1, 2, 1, 1]),
    (2, 2, [1, 1]),
    (7, 1, [7]),
])
def test_stages_split_by_layer_count_with_embedding_and_head_counted(layers, stages, sizes):
    from llmcluster.config.stages import stage_layers

    split = stage_layers(layers, stages)
    assert [len(r) for r in split] == sizes
    assert [i for r in split for i in r] == list(range(layers))  # every block once, in order


def test_more_stages_than_blocks_is_refused():
    from llmcluster.config.stages import stage_layers

    with pytest.raises(ValueError, match="at most 2 stages"):
        stage_layers(2, 3)
