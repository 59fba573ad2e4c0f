"""Phase 2, serving what was trained: size vLLM for a model on the cluster's GPUs (`serve plan`). Never imports torch."""

# Kubernetes: the official image, pinned by tag (the engine's flags change between releases). Here, not in engine.py,
# so that the CLI's parser can show it without importing the engine's config and pydantic (~0.4 s of every command).
VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
