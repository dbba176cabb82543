"""tunelab's evaluation engine: packed forward passes with shared few-shot prefixes (packed.py),
generation by continuous batching with per-row stops (generate.py), and several PEFT adapters of one base in the
same passes, each row through its own (route.py). Imports nothing else of evals/.
"""
