"""The router of a MoE layer and the token permutation around the experts.

The router is a (hidden x experts) GEMM over the rank's tokens, then a top-k over the scores
(softmax or sigmoid, memory-bound over the scores in fp32). Before the dispatch each token is copied
once per chosen expert into an expert-ordered buffer (permute) and after the combine the copies are
weighted and summed back (unpermute): each moves ``top_k`` copies of the token's hidden vector, read
and written (Megatron-Core ``moe_utils.permute`` / ``unpermute``). The auxiliary load-balancing loss
is a few reductions over the scores and is counted with them. Forward seconds; the backward moves
the same bytes again and runs the router GEMM's dgrad and wgrad.
"""

from __future__ import annotations

from typing import Any

SCORE_PASSES = 4
"""fp32 passes over the (tokens x experts) scores forward: the score function, top-k, the
normalisation of the chosen probabilities, the auxiliary loss's statistics."""


def router_time(rates: Any, model: Any, tokens: float, bpe: int) -> tuple[float, float]:
    """(GEMM seconds, memory-bound seconds) of the router and the permutation over ``tokens`` tokens."""
    e = model.moe.experts
    gemm = rates.gemm_time(2.0 * tokens * model.hidden * e) if rates.size is None else \
        rates.size.gemm_time(tokens, e, model.hidden)
    scores = SCORE_PASSES * 4.0 * tokens * e
    permute = 2 * 2.0 * tokens * model.moe.top_k * model.hidden * bpe  # permute and unpermute, read + write
    return gemm, rates.memory_time(scores + permute)
