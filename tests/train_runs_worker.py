"""Run under torchrun by test_preset_shapes.py: several `llmcluster train` runs of one world, one after the other,
in each rank's one process, through the CLI's own entry (`llmcluster.cli.main`, what `python -m llmcluster` calls):
torch, the trainer and torchrun start once per launch, not once per run (~5 s of CPU per process on 2 cores).
Each run joins a process group of its own and tears it down as the CLI does; it reads its store under a prefix
of its own (what a torchrun restart gets, distributed/process_groups.py `_attempt_store`), so no run can read a
gloo address an earlier run left there. Arguments: each run's `train ...` argv, the runs separated by `--next`;
rank 0 prints `=== run I` before run I. Exits with the first failing run's status, the later runs not started."""

import os
import sys

from llmcluster.cli import leave_past_distributed_teardown, main

runs: list[list[str]] = [[]]
for arg in sys.argv[1:]:
    if arg == "--next":
        runs.append([])
    else:
        runs[-1].append(arg)
code = 0
for i, argv in enumerate(runs):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"run{i}"
    if os.environ.get("RANK") == "0":
        print(f"=== run {i}", flush=True)
    code = main(argv)
    if code:
        break
leave_past_distributed_teardown(code)
sys.exit(code)
