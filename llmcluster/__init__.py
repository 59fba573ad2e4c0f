"""llmcluster: plan, validate, train on, launch, monitor and manage the storage of an LLM training cluster."""

__version__ = "0.1.0"
