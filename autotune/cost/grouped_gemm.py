"""The routed experts' GEMMs: one grouped GEMM per expert matrix (Megatron-Core ``--moe-grouped-gemm``,
torchtitan's grouped MM), each expert a problem of its own token count.

On a GPU priced from its shape (``datasheet.SizeModel``) the group is ``experts`` independent
(m x k) @ (k x n) products with m the tokens each expert receives: tile and wave losses make a small
per-expert count less efficient, which is why many small experts (or a wide expert parallelism
that leaves each few tokens) cost more than their FLOPs. Elsewhere (a measured profile's GEMM fit,
the flat rate, a CPU) the group is priced as one call of its total FLOPs, as the profile measured
one GEMM. Forward only: the backward's two GEMMs of each (dgrad, wgrad) are the forward's size each,
as ``compute.LayerCompute.bwd`` counts them.
"""

from __future__ import annotations

from typing import Any


def mlp_gemm_time(rates: Any, model: Any, tokens: float, width: float, groups: int = 1) -> float:
    """Forward GEMM seconds of ``groups`` MLPs of ``width`` (each its own slice of the weights) over
    ``tokens`` tokens in all: up (and gate) projection h -> (matrices - 1) * width, down projection
    width -> h; each group sees ``tokens / groups`` of them."""
    if tokens <= 0 or width <= 0 or groups < 1:
        return 0.0
    h, up = model.hidden, model.mlp_matrices - 1
    if rates.size is not None:
        sm, m = rates.size, tokens / groups
        return sm.gemm_time(m, up * width, h, groups) + sm.gemm_time(m, h, width, groups)
    return rates.gemm_time(2.0 * tokens * h * width * up) + rates.gemm_time(2.0 * tokens * width * h)


def activation_time(rates: Any, model: Any, tokens: float, width: float, bpe: int) -> float:
    """Forward seconds of the experts' elementwise work, memory-bound: their stored activations
    (``matrices * width`` per token copy, as ``activations.py`` counts a dense MLP's) written once and
    read once, as ``compute.layer_compute`` prices a dense block's."""
    nbytes = 2.0 * model.mlp_matrices * tokens * width * bpe
    return rates.size.stream_time(nbytes) if rates.size is not None else rates.memory_time(nbytes)
