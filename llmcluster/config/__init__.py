"""One config schema for jobs (`schema.JobConfig`), one for the cluster (`cluster.ClusterSpec`), the GPU/fabric
table, and the loaders with one-line errors."""

from llmcluster.config.load import load_job_config, config_to_dict  # noqa: F401
from llmcluster.config.schema import JobConfig, ModelConfig  # noqa: F401
