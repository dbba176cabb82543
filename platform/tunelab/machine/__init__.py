"""Where a cell's config meets the machine it runs on: device, dtype, attention, precision and process group
(runtime.py), and the stop signals a cell checkpoints on.

May import: core, folders, optimizers, plan.
"""
