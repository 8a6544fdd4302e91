"""The steps of one MoE layer's FFN, each timed on its own: what ``profile --layers`` prices an MoE block from.

``runtime/moe.py`` ``MoELayer.forward`` runs, per micro-batch (``runtime/expert_parallel.py``):

- ``router``: the router's GEMM in fp32, the scores, the top-k and its renormalisation, the
  per-sequence counts (``SequenceRouting``) and the auxiliary loss (``moe.route``);
- ``dispatch``: under tp without sequence parallelism the rank's ``1/tp`` of the tokens, then the
  permutation: every kept choice's copy of its token in expert order (``permute``) and the row
  counts per EP rank (``plan_exchange``);
- ``experts``: the rank's experts on the rows they receive, one expert after another
  (``through_experts``: under etp the rows of every etp rank at ``1/etp`` of each expert's width,
  the partial sums added);
- ``combine``: each row weighted by its routing weight and added to its token (``combine``), and
  under tp without sequence parallelism the gather of the tp ranks' parts;
- ``shared`` (a model with shared experts): the always-on FFN beside them.

The all-to-alls and the etp exchanges between them are not timed here (one process; the gloo table
prices them, ``cost/cpu_moe.py``). Each step runs on inputs drawn once from a forward of the
layer itself (``MoEParts``), so the shapes, routing and row counts are the layer's own; its
backward takes a gradient of ones on its outputs. ``ffn`` times the whole ``MoELayer`` (the same
steps chained by autograd): the reference the parts' sum is compared with
(``tests/unit/test_moe_parts.py`` checks the chained steps reproduce the layer's output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PARTS = ("router", "dispatch", "experts", "combine")
"""The steps whose measured seconds add up to the MoE FFN's price (``cost/cpu_moe.py``)."""
REFERENCE = "ffn"
"""The whole MoE FFN timed at once: the parts' sum is checked against it, never priced from it."""


def moe_layer(module: Any) -> Any:
    """The first ``MoELayer`` inside ``module`` (a ``moe`` piece's stage model)."""
    from autotune.runtime.moe import MoELayer

    return next(m for m in module.modules() if isinstance(m, MoELayer))


def _leaf(t: Any) -> Any:
    return t.detach().requires_grad_(t.is_floating_point())


def _backward(outs: tuple[Any, ...]) -> None:
    import torch

    outs = tuple(o for o in outs if o.requires_grad)
    torch.autograd.backward(outs, tuple(torch.ones_like(o) for o in outs))


class MoEParts:
    """One MoE layer's steps on the inputs each receives in ``layer(x)``: ``calls()`` gives each
    step's (forward, forward + backward)."""

    def __init__(self, layer: Any, x: Any):
        import torch

        from autotune.runtime import expert_parallel as X
        from autotune.runtime.moe import route

        self.layer, self.x = layer, x.detach()
        g = layer.ctx.groups
        with torch.no_grad():
            r = route(layer.router, self.x, layer.moe, layer.ctx)
            self.routing = (r.experts, r.weights.to(x.dtype), r.keep)
            self.tokens, idx, w, keep = self._split(self.x.reshape(-1, self.x.shape[-1]), *self.routing)
            p = X.permute(self.tokens, idx, w, keep, sum(g.shares))
            self.exchange = X.plan_exchange(p.counts, g)
            self.out = X.through_experts(p.rows, self.exchange, layer.experts, layer.first_expert, g.etp)
        self.rows, self.token_of, self.row_weights = p.rows, p.token_of, p.weights

    def names(self) -> tuple[str, ...]:
        """The steps this layer runs: ``PARTS``, and ``shared`` where it has shared experts."""
        return PARTS + (("shared",) if self.layer.moe.shared_experts else ())

    def _split(self, tokens, idx, weights, keep):
        """This rank's part of the tokens and their routing under tp without sequence parallelism."""
        from autotune.runtime.expert_parallel import split_tokens

        axis = self.layer.ctx.groups.token_split
        if axis.size == 1:
            return tokens, idx, weights, keep
        return (split_tokens(tokens, axis), split_tokens(idx, axis), split_tokens(weights, axis),
                None if keep is None else split_tokens(keep, axis))

    def router(self, backward: bool) -> None:
        from autotune.runtime.moe import route

        r = route(self.layer.router, _leaf(self.x), self.layer.moe, self.layer.ctx)
        if backward:
            _backward((r.weights, r.aux))

    def dispatch(self, backward: bool) -> None:
        from autotune.runtime import expert_parallel as X

        idx, w, keep = self.routing
        tokens, idx, w, keep = self._split(_leaf(self.x).reshape(-1, self.x.shape[-1]), idx, _leaf(w), keep)
        p = X.permute(tokens, idx, w, keep, sum(self.layer.ctx.groups.shares))
        X.plan_exchange(p.counts, self.layer.ctx.groups)
        if backward:
            _backward((p.rows, p.weights))

    def experts(self, backward: bool) -> None:
        from autotune.runtime import expert_parallel as X

        lay = self.layer
        out = X.through_experts(_leaf(self.rows), self.exchange, lay.experts, lay.first_expert, lay.ctx.groups.etp)
        if backward:
            _backward((out,))

    def combine(self, backward: bool) -> None:
        from autotune.runtime import expert_parallel as X

        y = X.combine(self.tokens, self.token_of, _leaf(self.out), _leaf(self.row_weights))
        axis = self.layer.ctx.groups.token_split
        if axis.size > 1:
            y = X.gather_tokens(y, axis)
        if backward:
            _backward((y,))

    def shared(self, backward: bool) -> None:
        y = self.layer.shared(_leaf(self.x))
        if backward:
            _backward((y,))

    def ffn(self, backward: bool) -> None:
        y = self.layer(_leaf(self.x))
        if backward:
            _backward((y,))

    def calls(self) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
        """{step: (forward, forward + backward)} for ``names()`` and ``REFERENCE``."""
        out = {}
        for name in (*self.names(), REFERENCE):
            fn = getattr(self, name)
            out[name] = (lambda fn=fn: fn(False), lambda fn=fn: self._clean(fn))
        return out

    def _clean(self, fn: Callable[[bool], None]) -> None:
        fn(True)
        for p in self.layer.parameters():
            p.grad = None

    def chained(self) -> Any:
        """The steps chained on the layer's input as ``MoELayer.forward`` chains them (the aux
        gradient aside): what the parity test compares with the layer's output."""
        import torch

        from autotune.runtime import expert_parallel as X

        lay, g = self.layer, self.layer.ctx.groups
        with torch.no_grad():
            tokens, idx, w, keep = self._split(self.x.reshape(-1, self.x.shape[-1]), *self.routing)
            p = X.permute(tokens, idx, w, keep, sum(g.shares))
            out = X.through_experts(p.rows, X.plan_exchange(p.counts, g), lay.experts, lay.first_expert, g.etp)
            y = X.combine(tokens, p.token_of, out, p.weights)
            if g.token_split.size > 1:
                y = X.gather_tokens(y, g.token_split)
            y = y.view_as(self.x)
            if lay.moe.shared_experts:
                y = y + lay.shared(self.x)
        return y
