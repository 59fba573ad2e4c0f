"""ft: per-step fault tolerance across replica groups, the training side, as one component (issues 37, 62).

The trainer knows torchft only through this package (docs/fault-tolerance.md):
  group.py      the Replica: a step's quorum, heal, cross-group average and commit; stragglers; the group's config
  quorum.py     the quorum on a cluster's terms: the group's own address, who may join, waiting, the run's end
  writer.py     which group writes the run's checkpoints, events and metrics, and how that role passes
  transport.py  the heal's data, MACed with the run's secret, checked against the receiver's own state

What renders and supervises the groups (the Lighthouse, the local supervisor, the Slurm script, the JobSet, the
run's secret) stays in launch/, which never imports this package: the head node needs no torch.
"""
