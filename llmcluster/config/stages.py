"""How a pipeline splits a decoder into stages: one fact, read by the trainer and the planner (no torch).

The embedding and the output head (final norm + lm_head) each count as one layer for balance, as
torchtitan's `generate_llm_fqn_per_model_part` does: the first stage's embedding look-up and the last
stage's vocabulary-sized matmul and loss take time, so those stages get one block fewer. Uneven splits are
allowed (BLOOM-176B: 70 blocks on 12 stages = the embedding and 5 blocks, 10 x 6 blocks, 5 blocks and the
head). A remainder goes first to the two end stages, then to the middle ones from the front: 80 blocks on 4
stages are 20 each, as an even split of the blocks alone would give.
"""

from __future__ import annotations


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """The transformer blocks of each stage, in order; raises ValueError when a stage would get none."""
    if stages < 1:
        raise ValueError(f"{stages} pipeline stages")
    if stages == 1:
        return [range(n_layers)]
    units = n_layers + 2  # + embedding + head
    base, extra = divmod(units, stages)
    sizes = [base] * stages
    for i in ([0, stages - 1] + list(range(1, stages - 1)))[:extra]:
        sizes[i] += 1
    sizes[0] -= 1   # the embedding
    sizes[-1] -= 1  # the head
    if min(sizes) < 1:
        raise ValueError(f"{n_layers} layers (+ embedding and head) cannot give each of {stages} pipeline "
                         f"stages a transformer block: at most {n_layers} stages")
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out
