"""An example search space: the built-in default space without pipeline parallelism.

    autotune search -m small -c local:4 -s 512 -b 8 --space docs/examples/no_pipeline_space.py

It keeps everything the default space does (its distributions, baselines, grid, moves and
placements) and refuses every point with more than one pipeline stage, which the search then
records as a limit ("no pipeline here") like any other infeasible point. A space of your own can
equally build plans from scratch: ``space(ctx)`` returns any object with the methods the search
calls (``search_spaces/base.py``, ``search_spaces/default.py``).
"""

from __future__ import annotations

from typing import Any

from search_spaces.base import Infeasible, SearchContext, family_of
from search_spaces.default import space as default_space

NAME = "no-pipeline"


class NoPipelineSpace:
    """The default space, delegating everything, whose ``build`` refuses pp > 1."""

    name = NAME

    def __init__(self, ctx: SearchContext):
        self.inner = default_space(ctx)
        self.ctx = ctx

    def __getattr__(self, attr: str) -> Any:  # distributions, baselines, grid_points, neighbours, ...
        if attr == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def build(self, params: dict[str, Any]) -> Any:
        plan = self.inner.build(params)
        if not isinstance(plan, Infeasible) and plan.degrees.pp > 1:
            return Infeasible("divisibility", f"no pipeline here: pp({plan.degrees.pp}) > 1", family_of(plan))
        return plan


def space(ctx: SearchContext) -> NoPipelineSpace:
    return NoPipelineSpace(ctx)
