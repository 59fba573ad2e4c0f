"""The model: a Llama-style decoder that knows nothing of parallelism, and its size/FLOPs arithmetic."""

from llmcluster.model.flops import flops_per_token, param_count  # noqa: F401
