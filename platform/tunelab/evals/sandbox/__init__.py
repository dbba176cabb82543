"""The HumanEval sandbox: model-written programs contained by the kernel (contain.py: bubblewrap
namespaces, the seccomp filter of seccomp.py, rlimits, a memory cgroup where one can be made: cgroup.py; what of
the host a program sees: view.py), started by boot.py inside, and their tests run by the judge (judge.py) in a
process of its own outside; values cross between them as plain data (wire.py). Imports nothing else of evals/.
"""
