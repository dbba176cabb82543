"""One cell's process (`python -m tunelab.cell RUN_DIR`): its stages (stages.py: model, data, PEFT, training,
evaluation) and the machine snapshot it keeps (environment.py: env.json).

May import: core, folders, optimizers, plan, machine, data, models, train, evals, report, checkpoint_scores, tools,
matrix, run.
"""
