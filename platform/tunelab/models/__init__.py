"""Models: a catalog alias, a local folder or a hub id -> model and tokenizer (loading.py); the aliases'
builders (catalog.py).

May import: core, folders, optimizers, plan, machine, data.
"""
