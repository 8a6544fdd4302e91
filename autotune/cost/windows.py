"""Sliding-window layers priced as they compute (GPT-OSS: a 128-token window on every other layer).

A windowed layer differs from a full one in its attention alone: each query attends at most
``window`` keys, so its QK^T and AV work is the pairs the causal mask and the window keep, counted
by the one pair rule of the cost model (``specs/windows.query_keys``, which the document masks use
too), and the rest of the block (GEMMs, norms, collectives) is the same. So a rank prices two
blocks, its full one and its windowed one (the same context with the windowed work, ``windowed``),
and each model chunk is the mean of its layers (``rank.py``).

* **CP shards.** A shard's windowed pairs are its segments' (zigzag: the front and the mirrored
  back segment), counted with the window; only the shard holding position 0 has queries that see
  fewer than ``window`` keys.
* **The ring over a window.** A key segment carries work for a query segment only when one of its
  keys lies inside some query's window (``ks + kl > qs - window + 1``): neighbouring chunks, not
  the whole ring (``ring_blocks``). The K/V passes themselves are priced as the ring runs them
  (``context_parallel.py``: cp - 1 passes), now behind less attention.
* **Memory.** The fused attention kernels keep O(s) state per head whatever the mask, and the CPU
  runtime's masked kernel materialises the full s x s scores as the causal one does, so a windowed
  layer keeps the activations of a full one (``memory.py`` unchanged).
* **Documents.** A window inside packed documents would need each document's windowed pairs per
  drawn step; ``check`` refuses the combination in one line rather than price it as either alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autotune.cost.ring import segments
from autotune.plan_parts import PlanError
from autotune.specs.windows import query_keys


@dataclass(frozen=True)
class WindowWork:
    """A rank's windowed layers: their attention work on its CP shard and how many each chunk holds."""

    keysum: float
    """Sum over the shard's queries of the keys each attends in a windowed layer."""
    ring: Any
    """The ring blocks that carry windowed work (``ring_blocks``); None without cp."""
    chunk_layers: tuple[int, ...]
    """Windowed layers of each model chunk of the rank."""
    chunk_moe: tuple[int, ...]
    """Of which MoE layers."""


def window_work(s: Any, cp_index: int, chunks: tuple[int, ...]) -> WindowWork | None:
    """The windowed work of the rank at CP index ``cp_index`` holding model chunks ``chunks`` (the
    schedule's placement); None for a model without windows."""
    m = s.model
    if not getattr(m, "window", 0):
        return None
    p = s.plan
    tokens = p.shares.tokens
    keysum, ring = _shard(tokens, cp_index, s.zigzag, s.seq_len, m.window, len(tokens) > 1)
    layers = tuple(p.shares.layers)
    first = [sum(layers[:j]) for j in range(len(layers))]
    per_chunk = [[i for i in range(first[j], first[j] + layers[j]) if m.is_window_layer(i)] for j in chunks]
    return WindowWork(keysum=keysum, ring=ring, chunk_layers=tuple(len(c) for c in per_chunk),
                      chunk_moe=tuple(sum(m.is_moe_layer(i) for i in c) for c in per_chunk))


@lru_cache(maxsize=4096)
def _shard(tokens: tuple[int, ...], index: int, zigzag: bool, seq_len: int, window: int, ring: bool
           ) -> tuple[float, Any]:
    segs = segments(tokens, zigzag, seq_len)
    keysum = sum(query_keys(a, a + n, 0, window) for a, n in segs[index])
    return keysum, ring_blocks(segs, index, window) if ring else None


def ring_blocks(segs: list[list[tuple[int, int]]], index: int, window: int) -> tuple[tuple[int, int, bool], ...]:
    """``(query length, key length, masked)`` of every (own query segment, key segment) pair in which
    some query sees some key through the window: the key segment starts before the query segment
    ends and ends after its first query's window begins. ``masked``: not every pair of the block is
    kept (the diagonal block, or one the window cuts), as ``ring.ring_blocks`` marks its causal ones."""
    out: list[tuple[int, int, bool]] = []
    for qs, ql in segs[index]:
        if not ql:
            continue
        for ksegs in segs:
            for ks, kl in ksegs:
                if kl and ks < qs + ql and ks + kl > qs - window + 1:
                    whole = ks + kl <= qs + 1 and ks >= qs + ql - window  # every query sees every key
                    out.append((ql, kl, not whole))
    return tuple(out)


def windowed(ctx: Any) -> Any:
    """``ctx`` as its windowed layers see it: their attention work in place of the full layers'."""
    w = ctx.window
    return ctx.with_work(ctx.step, ctx.coords, w.keysum, w.ring, ctx.attn_seq)


def check(plan: Any, model: Any) -> None:
    """Refuse what the windowed pricing does not cover, in one line."""
    if getattr(model, "window", 0) and plan.doc_mask:
        raise PlanError(f"doc_mask: model {model.name} has sliding-window layers; documents and windows together "
                        "are not priced (each document's windowed pairs per drawn step): drop doc_mask", field="doc_mask")
