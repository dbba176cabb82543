"""The edges of a search space: a study whose best value of a searched key lies at an end of its range says the
space may be too narrow (Google's Deep Learning Tuning Playbook, "Identifying bad search space boundaries": the
best trials should not sit at the boundary of the search space). The rule is the distribution's own
(`Dist.edge`: the outer tenth of a continuous range, in log space for log_uniform; the first or last value of an
int range or of a choice of numbers); this turns a study's winner into marks and words."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tunelab.matrix.tune_section import Dist


@dataclass(frozen=True)
class Edge:
    key: str
    side: str  # lower | upper
    value: Any
    low: Any  # the range's ends (a choice's smallest and largest value)
    high: Any


def of(space: dict[str, Dist], params: dict[str, Any]) -> list[Edge]:
    """The searched keys whose value in `params` lies at an edge of its range."""
    out = []
    for key, dist in space.items():
        side = dist.edge(params.get(key))
        if side is not None:
            ends = dist.edge_zones()
            out.append(Edge(key, side, params[key], ends["lower"][0], ends["upper"][1]))
    return out


def said(edge: dict[str, Any], best: str = "best") -> str:
    """'best at the upper edge of optim.lr (0.0025 in [1e-06, 0.01]): widen the space'."""
    value, low, high = (f"{v:.4g}" if isinstance(v, float) else str(v) for v in (edge["value"], edge["low"],
                                                                               edge["high"]))
    return f"{best} at the {edge['side']} edge of {edge['key']} ({value} in [{low}, {high}]): widen the space"
