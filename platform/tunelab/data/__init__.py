"""The data layer: recipes -> rendered prompts -> tokenized, label-masked, cached datasets.

Entry point: `tunelab.data.build.build` (not imported here, so reading a recipe stays cheap).

May import: core, folders, optimizers, plan, machine.
"""
