"""What `exp plan` prints of a matrix's searches before anything runs: the method groups, their space, the
trials and the compute budget (steps of the schedule, of the same trials unpruned, and of retraining)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tunelab.core.registries import PRUNERS
from tunelab.tune.plan import Group


def budget(g: Group) -> dict[str, Any]:
    """Optimizer steps the group's studies plan to train, what the same trials would train unpruned, and each
    study's winner's retraining (its first seed is the winning trial itself: evaluated, not trained again)."""
    n = g.spec.studies
    return {"trials": g.spec.trials, "studies": n, "steps_per_trial": g.schedule.full,
            "search_steps": n * g.schedule.planned_steps(), "full_search_steps": n * g.schedule.full_steps(),
            "retrain_steps": n * (len(g.seeds) - 1) * g.schedule.full,
            "baseline_steps": len(g.seeds) * g.schedule.full if g.spec.baseline else 0}


def method_groups(groups: list[Group]) -> list[Group]:
    """Each method group once (its first study): the plan shows a group's studies together."""
    return [g for g in groups if g.study_index == 0]


def space_text(g: Group) -> str:
    return ", ".join(f"{k} {d.kind} {list(d.values())}" for k, d in g.spec.space.items())


def plan_rows(groups: list[Group]) -> list[dict[str, Any]]:
    studies: dict[str, list[str]] = {}
    for g in groups:
        studies.setdefault(g.slug, []).append(g.study)
    return [{"group": g.slug, "study": g.study, "study_names": studies[g.slug], "workloads": g.spec.workloads,
             "varying": g.varying, "space": space_text(g),
             "sampler": g.spec.sampler, "pruner": g.spec.pruner, "intermediate": g.spec.intermediate,
             "metric": g.spec.metric,
             "direction": g.spec.direction, "schedule": g.schedule.describe(), "seeds": list(g.seeds),
             "storage": g.spec.storage, **budget(g)} for g in method_groups(groups)]


def plan_table(name: str, groups: list[Group]) -> Table:
    groups = method_groups(groups)
    total = sum(b["search_steps"] + b["retrain_steps"] + b["baseline_steps"] for b in map(budget, groups))
    studies = groups[0].spec.studies if groups else 1
    each = f", {studies} studies each" if studies > 1 else ""
    table = Table(title=f"{name}: {len(groups)} method groups searched with the same budget{each}, {total} "
                        "optimizer steps in all", title_justify="left")
    for col in ("group", "space", "search", "schedule (rung steps: trials)", "steps", "unpruned", "retrain"):
        table.add_column(col, justify="right" if col in ("steps", "unpruned", "retrain") else "left")
    for g, b in zip(groups, map(budget, groups)):
        ranks = f", rungs by {g.spec.ranked_by}" if PRUNERS[g.spec.pruner].rungs else ""
        times = f" x {studies} studies" if studies > 1 else ""
        table.add_row(g.slug, space_text(g), f"{g.spec.trials} trials{times}, {g.spec.sampler}, {g.spec.pruner}, "
                      f"{g.spec.direction} {g.spec.metric}{ranks}", g.schedule.describe(), str(b["search_steps"]),
                      f"{b['full_search_steps']} ({g.spec.trials} x {g.schedule.full}{times})",
                      f"{b['retrain_steps']} ({len(g.seeds)} seed{'s' * (len(g.seeds) != 1)}{times})")
    return table
