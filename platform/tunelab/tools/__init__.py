"""What a user does with finished cells: export a cell as a Hugging Face folder (export.py, with its model card:
modelcard.py), talk to it (chat.py), remove what is no longer needed (clean.py), and list what a matrix can name
(listing.py: `exp ls`).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores.
"""
