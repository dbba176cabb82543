"""GSM8K loaders for the task YAMLs (the logic lives in tunelab.evals.testsets.sources)."""

from tunelab.evals.testsets.sources import load, load_generated  # noqa: F401 - named by `custom_dataset`
