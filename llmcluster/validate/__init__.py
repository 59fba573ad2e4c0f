"""`llmcluster validate`: the bring-up checks of a training cluster, with numeric PASS/WARN/FAIL gates.

    result.py          the PASS/WARN/FAIL/SKIP items every check returns
    spec.py            expected figures and thresholds (--cluster SPEC), defaults per GPU model
    stack.py           OS, driver/CUDA/NCCL, InfiniBand, mounts, schedulers, torch, exporters, GPU health (no torch)
    nccl_semantics.py  nccl-tests' sizes, bus bandwidth factors and data pattern (no torch)
    collectives.py     the nccl-tests sweep over torch.distributed, with result checking
    compute.py         matmul TFLOP/s, device copy GB/s, PCIe H2D/D2H
    storage.py         sequential write/read and small-file rates per /storage area
    thermal.py         sustained load with NVML sampling
    nodes.py           cross-node outliers and Slurm drain
    distributed.py     torchrun / srun / local-spawn placement
    run.py, report.py  orchestration; tables, JSON and plots
"""
