"""The distributed runtime below the trainer and the checkpoint: process groups, the one device mesh and its
degrees (process_groups), and the torch-version shims (compat). Imports no room above it (docs/architecture.md)."""

# The ranks that share this host's cores (CPU training sets threads from it), where one launch cannot know: the
# local ft supervisor starts every replica group on one host. Torch-free, so launchers can name it.
HOST_RANKS_ENV = "LLMCLUSTER_HOST_RANKS"
# A local run's ranks: every TCPStore bound to 127.0.0.1 (distributed/loopback.py), gloo's pair listeners on the
# loopback interface. Torch-free, so launchers can name it.
LOOPBACK_FLAG = "LLMCLUSTER_LOOPBACK"
LOOPBACK_ENV = {LOOPBACK_FLAG: "1", "GLOO_SOCKET_IFNAME": "lo"}
