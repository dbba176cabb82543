"""GSM8K loaders for the task YAMLs (the logic lives in tunelab.evals.sources)."""

from tunelab.evals.sources import load, load_generated  # noqa: F401 - named by `custom_dataset`
