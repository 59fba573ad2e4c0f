"""Phase 2, serving what was trained: size vLLM for a model on the cluster's GPUs (`serve plan`). Never imports torch."""
