"""Each EP rank of a MoE layer priced on its own: its experts, its expected routed tokens, its device.

With uneven expert shares (``Shares.experts``) on a mixed cluster the EP ranks of one group differ in
what they hold and how fast they compute it, and the combine all-to-all waits for the slowest:

* EP rank q holding ``e_q`` of the E experts receives, of the N tokens the group routes (``top_k``
  copies each, balanced routing), ``N * top_k * e_q / E`` copies on average, and at the pace-setting
  draw ``imbalance(e_q)`` times that (``moe_imbalance.py``: mean plus the expected maximum of the
  group's ``ep`` normal deviations).
* Its expert GEMMs run at its own device's grouped-GEMM rate at ``received_q / e_q`` tokens per
  expert (``grouped_gemm.py``): a device twice as fast given twice the experts takes as long.
* In the dispatch rank q sends its copies for the other ranks' experts, ``tokens * top_k *
  (E - e_q) / E``, and receives from each of its ``ep - 1`` peers ``tokens * top_k * e_q / E``
  (at its imbalance); the all-to-all lasts as long as the rank that moves the most (send or receive).
* The layer's pace is the slowest rank's expert compute (``pace``).

Under even shares on one device type every rank is the same, and this is the busiest-rank pricing
the layer had before (``moe_layers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autotune.cost import grouped_gemm as GG
from autotune.cost import moe_imbalance as MI


@dataclass(frozen=True)
class RankLoad:
    """One EP rank's routed work in one MoE layer and micro-batch."""

    share: int
    """Experts it holds."""
    imbalance: float
    """Its pace-setting load over its mean load (>= 1)."""
    received: float
    """Token copies its experts process (after the etp gather), at that load."""


def loads(moe: Any, ep: int, etp: int, tokens: float, shares: Sequence[int]) -> tuple[RankLoad, ...]:
    """Every EP rank's load: ``tokens`` each of the group's ``ep * etp`` ranks routes, ``shares``
    the experts of each EP rank."""
    routed = ep * etp * tokens
    out = []
    for e in shares:
        imb = MI.imbalance(moe, ep, routed, e)
        out.append(RankLoad(share=e, imbalance=imb, received=routed * moe.top_k * e / moe.experts * imb))
    return tuple(out)


def expert_seconds(rates: Any, model: Any, load: RankLoad, width: float, bpe: int) -> float:
    """Forward seconds of one EP rank's routed experts (grouped GEMMs and activation), uncalibrated."""
    return (GG.mlp_gemm_time(rates, model, load.received, width, load.share)
            + GG.activation_time(rates, model, load.received, width, bpe))


def pace(seconds: Sequence[float]) -> int:
    """The EP rank the layer waits for: the one whose experts take longest (first of equals)."""
    return max(range(len(seconds)), key=lambda q: (seconds[q], -q))


def exchange_copies(moe: Any, ep: int, tokens: float, rank_loads: Sequence[RankLoad]) -> float:
    """Token copies the rank moving the most sends or receives in one direction of the all-to-all
    (``tokens`` each rank routes)."""
    if ep <= 1:
        return 0.0
    k, n_exp = moe.top_k, moe.experts
    return max(max(tokens * k * (n_exp - r.share) / n_exp, (ep - 1) * tokens * k * r.share / n_exp * r.imbalance)
               for r in rank_loads)
