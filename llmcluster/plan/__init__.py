"""Plan a cluster before buying it: memory, compute, time, checkpoints, network, power and cost.

Pure Python (no torch): `load.load_plan` -> `analyse.analyse` -> `report.render` / JSON.
"""
