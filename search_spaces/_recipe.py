"""The default space's recipe knobs: the Megatron options a MoE recipe turns on, searched where they apply.

* ``moe_a2a_overlap`` (False/True, ``Plan.moe_a2a_overlap``): a MoE model whose experts divide over
  more than one EP degree (the overlap needs ep > 1; a point with ep 1 leaves it idle);
* ``moe_dispatcher`` (alltoall/flex, ``Plan.moe_dispatcher``): like the overlap, where ep > 1 can be
  chosen, and only where the model routes dropless (Megatron-Core's DeepEP backend pads no capacity);
* ``cuda_graph_scope`` (``GRAPH_SCOPES``, ``Plan.cuda_graph_scope``): a MoE model (the graph saving is
  priced on MoE layers only, ``plan_checks``); the scopes as Megatron-Bridge recipes set them.

A study has a knob only where its target runs the option: ``targets.expresses`` asks the target's own
refusals (the runtime and torchtitan, DeepSpeed, Accelerate refuse all of them, Megatron runs them), so
a search for one of them samples nothing it would refuse.

bf16 gradient reduction (``Plan.grad_reduce``) is no knob: the cost model finds it cheaper on every
plan, but it changes the numerics (gradients summed over the data-parallel ranks in bf16), which is the
user's call, not the search's. ``--grad-reduce bf16`` (``SearchContext.grad_reduce``) sets it on every
plan of a study.
"""

from __future__ import annotations

from typing import Any

GRAPH_SCOPES = ("none", "attn", "moe_router/moe_preprocess", "attn/moe_router/moe_preprocess")
"""The CUDA graph scopes searched: none, the attention, the router with the dispatcher's preprocessing
(Megatron Core captures moe_preprocess only with moe_router), and all three (what the Megatron-Bridge
recipes that capture graphs set)."""
EP_KNOBS = ("moe_a2a_overlap", "moe_dispatcher")
"""The knobs that change nothing at ep 1 (idle there)."""
OFF = {"moe_a2a_overlap": False, "moe_dispatcher": "alltoall", "cuda_graph_scope": "none"}
"""Each knob's value that leaves its option off (a baseline's, a grid's first)."""


def knobs(ctx: Any, moe: Any, ep_divs: list[int]) -> dict[str, tuple[Any, ...]]:
    """The recipe knobs of a study and their choices (empty for a dense model: its study is as before)."""
    if moe is None:
        return {}
    from autotune.targets import context, expresses

    tctx = context(ctx.model, ctx.cluster, ctx.seq_len, ctx.global_batch)
    out: dict[str, tuple[Any, ...]] = {}
    if len(ep_divs) > 1 and expresses(ctx.target, "moe_a2a_overlap", tctx):
        out["moe_a2a_overlap"] = (False, True)
    if len(ep_divs) > 1 and moe.router.dropless and expresses(ctx.target, "moe_dispatcher", tctx):
        out["moe_dispatcher"] = ("alltoall", "flex")
    if expresses(ctx.target, "cuda_graph_scope", tctx):
        out["cuda_graph_scope"] = GRAPH_SCOPES
    return out


def plan_fields(p: dict[str, Any], ep: int) -> dict[str, Any]:
    """The Plan fields of point ``p``'s recipe knobs (absent knobs: the options off)."""
    scope = p.get("cuda_graph_scope", "none")
    return {"moe_a2a_overlap": bool(p.get("moe_a2a_overlap", False)) and ep > 1,
            "moe_dispatcher": p.get("moe_dispatcher", "alltoall") if ep > 1 else "alltoall",
            "cuda_graph_scope": () if scope == "none" else tuple(scope.split("/"))}
