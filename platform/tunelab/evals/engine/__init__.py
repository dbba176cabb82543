"""tunelab's evaluation engine: packed forward passes with shared few-shot prefixes (packed.py) and
generation by continuous batching with per-row stops (generate.py). Imports nothing else of evals/.
"""
