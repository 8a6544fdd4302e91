"""The runtime's own decoder block and head at a reference shape: what a CPU trial's pieces cost in context.

The kernel sweeps time each GEMM, attention call and elementwise operator alone, hot in the cache. A
CPU trial runs them one after another inside eager autograd, and there they cost more: measured on
this project's 2-core Xeon (AMX) with the ``small`` model, a bf16 block at micro-batch 1 took ~2x the
sum of its kernels timed alone (GEMMs whose operands the elementwise operators between them evicted
from L2, ~230 operator dispatches with their autograd nodes per block fwd + bwd, bf16 elementwise
kernels converting every element), and the excess does not scale with the micro-batch: part is fixed
per call. So the profile also times the runtime's real block and head (``autotune/runtime/model.py``,
as ``profilers/layers.py`` builds them) at one reference shape and two micro-batch sizes in each
precision it measures, and the cost model (``autotune/cost/cpu.py`` ``Context``) maps its kernel
price onto these: per precision and direction, measured = fixed + factor x kernel price, the two
micro-batches fixing both (docs/cpu-constants.md, "In context").

The reference shape is none of the presets' (``REF_MODEL``): between ``tiny`` and ``small`` in width,
GQA, SwiGLU, so no trial model is its own reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.specs.model import ModelSpec

REF_MODEL = ModelSpec(name="cpu-ref", layers=1, hidden=160, heads=5, kv_heads=1, ffn_hidden=448, vocab=1280,
                      source="profilers/block_ref.py: the CPU profile's reference block (no preset's shape)")
"""head_dim 32, GQA 5:1, MLP 2.8x: a small transformer block unlike any preset's."""
REF_SEQ = 160
REF_MBS = (1, 4)
"""Two micro-batch sizes: how the in-context cost grows with the tokens."""
FIXED_MODEL = ModelSpec(name="cpu-fixed", layers=1, hidden=40, heads=5, kv_heads=1, ffn_hidden=112, vocab=80,
                        source="profilers/block_ref.py: the same block at a negligible size (its fixed costs)")
"""``REF_MODEL``'s structure (the same operators, dispatched the same number of times) at a size
where the kernels' work is negligible: the block's fixed cost per call, measured (micro-batch 1,
``FIXED_SEQ`` tokens; stored as micro-batch 0)."""
FIXED_SEQ = 8
PIECES = ("block", "head")


def ref_points(device: str) -> tuple[tuple[str, int], ...]:
    """(piece, micro-batch) pairs measured (CPU only: a GPU's stream hides the per-call costs)."""
    if device.startswith("cuda"):
        return ()
    return tuple((p, b) for p in PIECES for b in (0, *REF_MBS))


def ref_calls(piece: str, mbs: int, device: str, dtype: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, forward + backward) of the reference ``piece`` at ``mbs`` in torch ``dtype`` (``mbs``
    0: ``FIXED_MODEL`` at micro-batch 1)."""
    from profilers.pieces import Piece

    p = (Piece(piece, FIXED_MODEL, 1, 1, FIXED_SEQ, device, dtype) if mbs == 0 else
         Piece(piece, REF_MODEL, 1, mbs, REF_SEQ, device, dtype))
    return p.fwd, p.fwd_bwd


def _shape(m: ModelSpec, seq: int) -> dict[str, Any]:
    return {"hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden, "vocab": m.vocab,
            "activation": m.activation, "seq": seq}


def ref_shape() -> dict[str, Any]:
    """The reference shapes as the profile stores them (the cost model rebuilds the models from them):
    ``REF_MODEL`` at ``REF_SEQ``, with ``fixed``: ``FIXED_MODEL`` at ``FIXED_SEQ``."""
    return {**_shape(REF_MODEL, REF_SEQ), "fixed": _shape(FIXED_MODEL, FIXED_SEQ)}


def fit_block_ref(samples: list[dict]) -> dict:
    """``{dtype: {"shape": {...}, "points": [[piece, mbs, fwd_s, bwd_s], ...]}}`` of one rank's
    ``block_ref`` samples ({} without them)."""
    out: dict = {}
    rows = [s for s in samples if s["kind"] == "block_ref"]
    for s in sorted(rows, key=lambda s: (s["params"]["dtype"], s["params"]["piece"], s["params"]["mbs"])):
        p = s["params"]
        d = out.setdefault(p["dtype"], {"shape": p["shape"], "points": []})
        d["points"].append([p["piece"], p["mbs"], s["metrics"]["fwd_s"], s["metrics"]["bwd_s"]])
    return out
