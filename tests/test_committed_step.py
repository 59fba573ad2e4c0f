"""Invariant 1, "a committed step is final" (issue 62; docs/fault-tolerance.md, "Invariants"), as a property of the
one function that moves a step_<N> (Checkpointer.set_aside), in one process: random orders of writes by several
writers (each a Checkpointer of its own, as each group's process has), corruptions and operator roll-backs. After
every write of a step that verified before it, the step is byte for byte what it was, nothing of it was set aside,
and that writer writes no more; a step that did not verify is set aside and replaced by the new write."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import pytest
import torch

from llmcluster.checkpoint.checkpointer import Checkpointer, verify_checkpoint
from llmcluster.storage.layout import Storage

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

WRITERS, STEPS = 3, (2, 4, 6)


def _tree(d: Path) -> dict[str, str]:
    """Every file of a step, by its sha256: what "untouched" means."""
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def _aside(run_dir: Path) -> list[tuple[str, dict]]:
    return sorted((f"{a.name}/{s.name}", _tree(s)) for a in run_dir.glob(".abandoned-*") for s in a.iterdir())


class Run:
    """A run's checkpoints folder and the writers that may write into it; `lines`: what they said."""

    def __init__(self, root: Path):
        self.storage, self.lines = Storage(root), []
        self.writers = [Checkpointer(self.storage, "r", 0, 1, keep_last=100, log=self.lines.append)
                        for _ in range(WRITERS)]
        self.models = []
        for w in range(WRITERS):
            torch.manual_seed(w)
            m = torch.nn.Linear(2, 2)
            self.models.append((m, torch.optim.SGD(m.parameters(), lr=0.1)))
        self.dir = self.writers[0].dir

    def write(self, w: int, step: int) -> None:
        final = self.dir / f"step_{step}"
        committed = final.is_dir() and verify_checkpoint(final) is None
        before, aside, refused = (_tree(final) if final.is_dir() else None), _aside(self.dir), self.writers[w].refused
        model, opt = self.models[w]
        with torch.no_grad():
            model.weight.add_(step + w)   # each writer's copy of a step holds weights of its own
        path = self.writers[w].save(step, model, opt, {})
        if committed or refused:   # kept byte for byte, nothing set aside, the writer stops writing
            assert path is None and (_tree(final) if final.is_dir() else None) == before
            assert _aside(self.dir) == aside
            assert self.writers[w].refused
            if not refused:
                assert self.lines[-1].endswith("this process writes no more checkpoints"), self.lines[-1]
        else:                      # absent or failed verification: written, and the failed copy set aside
            assert path == final and verify_checkpoint(final) is None
            new_aside = [t for t in _aside(self.dir) if t not in aside]
            assert [(n.split("/")[1], t) for n, t in new_aside] == ([(final.name, before)] if before else [])

    def corrupt(self, step: int) -> None:
        shards = sorted((self.dir / f"step_{step}").glob("*.distcp"))
        if shards:
            data = bytearray(shards[0].read_bytes())
            data[len(data) // 2] ^= 0xFF
            shards[0].write_bytes(bytes(data))

    def roll_back(self, step: int) -> None:
        """An operator's `--resume PATH` to step_<step>: the steps above it go aside, verifying or not."""
        path = self.dir / f"step_{step}"
        if not (path.is_dir() and verify_checkpoint(path) is None):
            return
        above = [d for d in self.dir.glob("step_*") if int(d.name[5:]) > step]
        operator = Checkpointer(self.storage, "r", 0, 1, keep_last=100, log=self.lines.append)
        operator.prepare_start(str(path), path, step)
        assert not any(d.exists() for d in above)


OPS = st.lists(st.one_of(st.tuples(st.just("write"), st.integers(0, WRITERS - 1), st.sampled_from(STEPS)),
                         st.tuples(st.just("corrupt"), st.just(0), st.sampled_from(STEPS)),
                         st.tuples(st.just("roll_back"), st.just(0), st.sampled_from(STEPS))),
               min_size=1, max_size=8)


@hypothesis.settings(max_examples=25, deadline=None, derandomize=True)
@hypothesis.given(OPS)
def test_no_write_replaces_or_moves_a_committed_step(ops):
    with tempfile.TemporaryDirectory() as root:
        run = Run(Path(root))
        for op, w, step in ops:
            if op == "write":
                run.write(w, step)
            elif op == "corrupt":
                run.corrupt(step)
            else:
                run.roll_back(step)


def test_a_second_writer_of_a_committed_step_says_so_in_one_line_and_writes_no_more(tmp_path):
    run = Run(tmp_path)
    run.write(0, 4)
    sealed = _tree(run.dir / "step_4")
    run.write(1, 4)
    run.write(1, 6)   # writes no more, even a step nobody has
    assert _tree(run.dir / "step_4") == sealed and not (run.dir / "step_6").exists()
    said = [ln for ln in run.lines if "already committed" in ln]
    assert said == [f"{run.dir / 'step_4'} is already committed (it verifies): a committed step is final, so this "
                    "write is discarded and this process writes no more checkpoints"], run.lines
    assert not list(run.dir.glob(".tmp-*")) and not list(run.dir.glob(".abandoned-*"))


def test_resume_auto_sets_aside_only_what_fails_verification(tmp_path):
    """`--resume auto` chose step_2; step_4 failed verification, step_6 was committed since (a live writer of the
    run): step_4 goes aside, step_6 stays, and the start is refused in one line instead of forking the run."""
    run = Run(tmp_path)
    for step in STEPS:
        run.write(0, step)
    run.corrupt(4)
    late = Checkpointer(run.storage, "r", 0, 1, keep_last=100, log=run.lines.append)
    with pytest.raises(Exception, match="step_6 was committed after this process chose to resume from step 2"):
        late.prepare_start("auto", run.dir / "step_2", 2)
    assert verify_checkpoint(run.dir / "step_6") is None
    assert [n.split("/")[1] for n, _ in _aside(run.dir)] == ["step_4"]
