"""The end of a run, decided once (docs/fault-tolerance.md, "Invariants" 2 and 4): `checkpoints/<run>/FINISHED.json`,
written by whoever commits the run's final step, after its completion marker. Read by the ft groups (ft/quorum.py:
a group back after the end ends without training) and by the launchers (launch/ft_local.py and the Slurm script:
groups still running a grace after the end are stopped). No torch here: the head node reads it."""

from __future__ import annotations

import json
from pathlib import Path

from llmcluster.storage.layout import COMPLETE_MARKER
from llmcluster.storage.owned import read_text

END_RECORD = "FINISHED.json"
UNRECORDED = "not recorded: its writer left before recording it"


def recorded_end(run_dir: Path, last_step: int) -> tuple[int, str] | None:
    """(the last step, its weights' digest) when the run's final step is committed: `step_<last>` holds its
    completion marker (an operator's roll-back moves it aside, and with it the end; an extended run has another last
    step). The digest is the record's; a writer that died between sealing the step and recording it left none, and
    the run has ended all the same. A record that is not a record's shape or of another step gives no digest: it
    can only name one, never start or stop anything."""
    if not (run_dir / f"step_{last_step}" / COMPLETE_MARKER).is_file():
        return None
    text, _why = read_text(run_dir / END_RECORD)
    try:
        record = json.loads(text or "null")
        if int(record["step"]) == last_step:
            return last_step, str(record["weights_sha256"])
    except (ValueError, TypeError, KeyError):
        pass
    return last_step, UNRECORDED
