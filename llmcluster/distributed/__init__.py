"""The distributed runtime below the trainer and the checkpoint: process groups, the one device mesh and its
degrees (process_groups), and the torch-version shims (compat). Imports no room above it (docs/architecture.md)."""
