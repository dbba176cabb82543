"""Where a benchmark's test set comes from: a local folder, the hub or the offline cache (sources.py,
files.py), `exp eval pull` (pull.py), and the few-shot exemplars lm-eval ships in its YAMLs (exemplars.py).
"""
