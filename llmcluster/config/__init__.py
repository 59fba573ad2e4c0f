"""One config schema for jobs (`schema.JobConfig`), the GPU table, and the loader with one-line errors."""

from llmcluster.config.load import load_job_config, config_to_dict  # noqa: F401
from llmcluster.config.schema import JobConfig, ModelConfig  # noqa: F401
