"""Optuna's TPE, with each finished trial's parameters turned into TPE's internal form once.

``TPESampler`` rebuilds its two Parzen estimators on every ``ask`` from every finished trial,
converting each trial's parameters to their internal representation again each time
(``_get_internal_repr``): at 128 devices the sampler's study holds ~800 trials (the baselines and
balanced starts come first) of ~20 parameters, and that loop was a quarter of the sampler's time.
A finished trial's parameters never change, so this subclass keeps each trial's converted row
(per search space) and assembles the same arrays from them. Nothing else of TPE changes:
tests/unit/test_search_tpe.py checks that it suggests exactly what ``optuna.samplers.TPESampler``
does with the same seed and history, and fails if Optuna renames or reshapes the method it
overrides.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optuna

_LIMIT = 200_000  # rows kept per search space before the cache starts over


class MemoTPESampler(optuna.samplers.TPESampler):
    """``TPESampler`` with the per-trial internal representation cached (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._rows: dict[tuple, dict[int, tuple[Any, tuple[float, ...] | None]]] = {}

    def _get_internal_repr(self, trials: list[Any], search_space: dict[str, Any], study: Any) -> dict[str, np.ndarray]:
        items = tuple(search_space.items())
        cache = self._rows.setdefault(items, {})
        if len(cache) > _LIMIT:
            cache.clear()
        rows = []
        for t in trials:
            hit = cache.get(id(t))
            if hit is None or hit[0] is not t:
                row = None
                if t.state.is_finished():  # a running trial's parameters may still grow: never cached
                    params = self._get_params(t, study)
                    if search_space.keys() <= params.keys():
                        row = tuple(d.to_internal_repr(params[k]) for k, d in items)
                    hit = cache[id(t)] = (t, row)  # the entry holds the trial: its id is not reused
                else:
                    return super()._get_internal_repr(trials, search_space, study)
            if hit[1] is not None:
                rows.append(hit[1])
        if not rows:
            return {k: np.asarray([]) for k in search_space}
        cols = list(zip(*rows, strict=True))
        return {k: np.asarray(cols[i]) for i, (k, _) in enumerate(items)}
