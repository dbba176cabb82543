"""The base every layer stands on: the cell schema (config.py), errors and the exit-2 paragraph (errors.py),
registries of every extension point and their facts (registry.py, registries.py), what a process layout can run
(layouts.py), atomic writes and JSON lines (files.py), folder locks (locks.py), progress events (events.py), where
tunelab keeps its caches (paths.py), how it reaches the Hugging Face hub (hub_access.py) and dotted config keys
(keys.py). Nothing here imports torch.

May import: nothing of tunelab (the bottom layer).
"""
