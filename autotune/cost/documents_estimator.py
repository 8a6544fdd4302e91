"""The search's estimator for a workload of documents (``cost/documents.py`` prices one plan's
masked windows; ``cost/estimate.py`` composes them into a step): a callable like ``estimate`` that
prices each plan with document masks and picks its balance. Above both, so the estimate and the
document pricing never import each other.
"""

from __future__ import annotations

from autotune import documents as W
from autotune.cost.estimate import estimate


class DocumentsEstimator:
    """The search's estimator for a workload of documents: prices every plan with ``doc_mask`` on,
    both balances where there are replicas to balance (the search may choose either: the faster
    is recorded on the plan). Picklable (worker processes)."""

    def __init__(self, dist: W.LengthDistribution, balance: str = "auto"):
        self.dist, self.balance = dist, balance

    def __call__(self, plan, model, cluster, seq_len, global_batch, *, calibration=None, timeline=False):
        choices = ("count", "cost") if self.balance == "auto" else (self.balance,)
        if plan.degrees.dp == 1:
            choices = choices[:1]
        best = None
        for b in choices:
            est = estimate(plan.replace(doc_mask=True, balance=b), model, cluster, seq_len, global_batch,
                           calibration=calibration, timeline=timeline, documents=self.dist)
            if best is None or est.predicted.get("tokens_per_s", 0) > best.predicted.get("tokens_per_s", 0):
                best = est
        return best
