"""The micro-batch a start can grow to: its memory, priced at micro-batch 1, read in closed form.

A balanced start (``DefaultSpace.starts``) is priced at micro-batch 1. The best plans of the mixed
clusters of issue 26 run micro-batch 4-16: from micro-batch 1 the polish walked there in 3-6 climb
steps of 30-100 prices each, most of a search's time. A rank's memory is affine in the micro-batch
size (activations and logits scale with it, model states do not, the allocator's reserve is a fixed
part plus a fraction of the rest: ``cost/memory.micro_batches_that_fit`` reads ``rank_memory``
backwards), so the start's own breakdown says how large a micro-batch every rank holds; the
pipeline must still get at least ``pp`` micro-batches per replica (a 1F1B-like schedule needs them
to fill).
"""

from __future__ import annotations

import math
from typing import Any

from autotune.cost.memory import micro_batches_that_fit


def largest_micro_batch(rows: list[dict[str, Any]] | None, samples: int, pp: int, max_mbs: int) -> int:
    """The largest power-of-two micro-batch (<= ``max_mbs``) that every rank of ``rows`` (a
    breakdown's per-rank rows at micro-batch 1) holds and that leaves each replica of ``samples``
    at least ``pp`` micro-batches; 1 when the rows are not there (a stored trial far from the best
    keeps none: autotune/search/workspace.py)."""
    top = min(max_mbs, max(1, samples // max(1, pp)))
    for r in rows or ():
        terms, cap = r.get("memory"), r.get("capacity_bytes")
        if not isinstance(terms, dict) or not cap:
            return 1
        fits = micro_batches_that_fit(terms, cap)
        if fits is not None:
            top = min(top, fits)
    return 2 ** int(math.log2(top)) if top >= 1 else 1
