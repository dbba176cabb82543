"""lm-eval as the harness: the bridge from an eval section to lm-eval's tasks (harness.py), lm-eval's
LM interface served by tunelab's engine on the model in memory (lm.py; for several adapters at once: fanout.py),
where lm-eval's own tasks get their data (lmdata.py), lm-eval's output as results.json entries (results.py),
IFEval's Punkt model (nltk_data.py) and the per-subject task YAMLs of tasks/ (taskgen.py). Imports evals/engine
and evals/testsets.
"""
