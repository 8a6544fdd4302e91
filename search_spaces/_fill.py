"""The micro-batch a start can grow to: its memory, priced at micro-batch 1, read in closed form.

A balanced start (``DefaultSpace.starts``) is priced at micro-batch 1. The best plans of the mixed
clusters of issue 26 run micro-batch 4-16: from micro-batch 1 the polish walked there in 3-6 climb
steps of 30-100 prices each, most of a search's time. A rank's memory is affine in the micro-batch
size (activations and logits scale with it, model states do not, the allocator's reserve is a fixed
part plus ``RESERVE_FRACTION`` of the rest: ``cost/memory.rank_memory``), so the start's own
breakdown says how large a micro-batch every rank holds; the pipeline must still get at least ``pp``
micro-batches per replica (a 1F1B-like schedule needs them to fill).
"""

from __future__ import annotations

import math
from typing import Any

from autotune.cost.memory import RESERVE_FRACTION

_STATES = ("weights", "gradients", "optimizer")


def largest_micro_batch(rows: list[dict[str, Any]] | None, samples: int, pp: int, max_mbs: int) -> int:
    """The largest power-of-two micro-batch (<= ``max_mbs``) that every rank of ``rows`` (a
    breakdown's per-rank rows at micro-batch 1) holds and that leaves each replica of ``samples``
    at least ``pp`` micro-batches; 1 when the rows are not there (kept up to 64 ranks only)."""
    top = min(max_mbs, max(1, samples // max(1, pp)))
    for r in rows or ():
        terms, cap = r.get("memory"), r.get("capacity_bytes")
        if not isinstance(terms, dict) or not cap:
            return 1
        states = sum(terms[k] for k in _STATES)
        per = terms["activations"] + terms["logits"]
        fixed = terms["reserve"] - RESERVE_FRACTION * (states + per)
        room = (cap - fixed) / (1 + RESERVE_FRACTION) - states
        if per > 0:
            top = min(top, int(room // per))
    return 2 ** int(math.log2(top)) if top >= 1 else 1
