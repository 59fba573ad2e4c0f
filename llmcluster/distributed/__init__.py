"""The distributed runtime below the trainer and the checkpoint: process groups, the one device mesh and its
degrees (process_groups), and the torch-version shims (compat). Imports no room above it (docs/architecture.md)."""

# The ranks that share this host's cores (CPU training sets threads from it), where one launch cannot know: the
# local ft supervisor starts every replica group on one host. Torch-free, so launchers can name it.
HOST_RANKS_ENV = "LLMCLUSTER_HOST_RANKS"
