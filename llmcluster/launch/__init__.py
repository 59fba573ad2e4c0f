"""Launching a job: the launch spec and the schedulers that render it (local, Slurm, Kubernetes, SkyPilot). No torch
here."""

# Here, not in spec.py, so that the CLI's parser can list them without importing the config schema and pydantic
# (~0.4 s of every command's start).
SCHEDULERS = ("local", "slurm", "k8s", "skypilot")
