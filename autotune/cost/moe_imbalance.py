"""Load imbalance of routed experts: how much more than its even share the busiest EP rank computes
and receives in one MoE layer. Every MoE layer waits for that rank (the combine all-to-all
synchronises the EP group), so expert compute and dispatch are priced at its load.

* ``force_balance`` (benchmarking): tokens are spread evenly, factor 1.
* Token dropping with a capacity factor ``c`` (``dropless: false``): each expert's buffer is padded
  to ``c`` times its even share (Megatron ``--moe-pad-expert-input-to-capacity``), so every rank
  computes ``c`` times the even load: factor ``c``.
* Dropless: each of the N tokens the EP group routes picks ``top_k`` distinct experts out of E. With
  the balanced routing the auxiliary loss drives towards (every expert equally likely), the number of
  picks landing on an EP rank holding e experts is a sum of N independent hypergeometric draws (k
  picks from E, e of them "this rank"): mean N*k*e/E, variance N*k*(e/E)*(1 - e/E)*(E - k)/(E - 1).
  The busiest of ``ep`` ranks is priced at the mean plus the expected maximum of ``ep`` standard
  normals times the deviation (Blom's approximation of the normal order statistic,
  ``Phi^-1((n - 0.375) / (n + 0.25))``; Blom 1958, "Statistical Estimates and Transformed
  Beta-Variables"). This is the floor a perfectly balanced router reaches; a trained router's
  preferences add to it, and no measured skew is assumed here.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any


def expected_max_normal(n: int) -> float:
    """Expected maximum of ``n`` independent standard normals (Blom's approximation; 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def imbalance(moe: Any, ep: int, tokens: float, share: int) -> float:
    """Busiest EP rank's routed load over its even load (>= 1): ``moe`` the model's ``MoESpec``,
    ``ep`` ranks, ``tokens`` routed by the EP group in one MoE layer and micro-batch, ``share`` the
    experts the busiest rank holds."""
    r = moe.router
    if r.force_balance:
        return 1.0
    if not r.dropless:
        return float(r.capacity_factor)
    if ep <= 1 or tokens <= 0:
        return 1.0
    e, k = moe.experts, moe.top_k
    p = share / e
    mean = tokens * k * p
    var = tokens * k * p * (1 - p) * ((e - k) / (e - 1) if e > 1 else 0.0)
    if mean <= 0 or var <= 0:
        return 1.0
    return 1.0 + expected_max_normal(ep) * math.sqrt(var) / mean
