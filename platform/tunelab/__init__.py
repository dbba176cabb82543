"""tunelab: instruction-tuning experiment platform."""

__version__ = "0.1.0"
