"""Where a cell's config meets the machine it runs on: device, dtype, attention, precision and process group
(runtime.py), and the stop signals a cell checkpoints on; each process's share of the CPUs, its threads and
waiting policy (threads.py); how busy its CPUs are and what a user is told when the machine slows a cell (load.py).

May import: core, folders, optimizers, plan.
"""
