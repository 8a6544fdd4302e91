"""`tune` measures the model it tunes: its real pieces in each precision, then the grid the search prices.

A CPU trial's step is made of what a kernel profile cannot see in isolation: ~230 operator dispatches
per block and micro-batch (its autograd nodes, views, casts), GEMMs whose operands the elementwise
operators between them evicted from the cache, bf16 elementwise kernels that convert every element
(docs/cpu-constants.md, "What the kernel curves miss"). So before it searches, `tune` times the
runtime's own ``embed``, ``block`` and ``head`` (``profilers/layers.py``, one thread, the thread's
CPU clock: another process's slices are not counted) and hands them to the cost model as the
device's layer profile (``autotune/cost/layers.py`` prices a plan's pieces from them first):

1. **precision** (``--dtype auto``): one block and the head at one micro-batch in every precision this
   CPU computes natively; the fastest per token is the one searched, validated and exported (bf16
   on a CPU without bf16 units is another machine: no AMX / AVX-512-BF16, each element converted);
2. **grid**: every piece at each micro-batch size the search can choose (the divisors of the
   global batch), the workload's sequence, and each tp shard the local ranks can split the model
   into, in that precision;
3. **update** (``profilers/update_costs.py``): the runtime's own optimizer step and, in bf16 / fp16,
   its per-micro-batch fp32 gradient accumulation, stored with the layers (``meta["update"]``) and
   counted in the precision probe too (fp32 accumulates nothing, its update copies nothing back);
4. **FSDP2** (``profilers/fsdp_costs.py``, where the search has two ranks or more): what a ZeRO-2 and
   a ZeRO-3 step add on a rank's thread (FSDP2's copies, casts, hooks and accumulation, per step and
   per micro-batch, and its update over DTensor shards), timed on two gloo ranks of their own and
   stored with the layers (``meta["fsdp"]``); not in the precision probe (only ZeRO-2/3 plans pay it).

The first three are timed beside ``world - 1`` helper processes doing the same work
(``profilers/twins.py``): a trial's ranks share the cores' cache and memory bandwidth, which one
process timed alone, the other cores idle, does not see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROBE_MBS = 2
"""Micro-batch the precision probe times (small enough to be quick, large enough that the GEMMs and
attention, not the dispatch, decide; capped by the global batch)."""


@dataclass(frozen=True)
class Precision:
    """The precision ``tune`` runs in and why."""

    dtype: str
    per_token_s: dict[str, float]
    """Measured seconds per token (fwd + bwd of every block and the head) per precision probed."""
    note: str


def candidate_dtypes(cluster: Any) -> list[str]:
    """Precisions every device of ``cluster`` has (its profile's measured GEMM dtypes where measured),
    in ``choose_dtype``'s order of preference."""
    types = list(cluster.device_types())
    return [dt for dt in ("bf16", "fp16", "fp32") if all(dt in t.peak_flops for t in types)]


def layer_grid(model: Any, global_batch: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(micro-batch sizes, tp shards, ep degrees) the search on ``world`` local ranks can price: every
    divisor of the global batch, every tp dividing the world that splits the model evenly, and for an
    MoE model every ep dividing the world and its experts ((1,) for a dense model)."""
    from profilers.layers import ep_sizes, shard_sizes

    mbs = tuple(b for b in range(1, global_batch + 1) if global_batch % b == 0)
    divisors = tuple(t for t in range(1, world + 1) if world % t == 0)
    tps, _ = shard_sizes(model, divisors)
    return mbs, tps, ep_sizes(model, divisors)


def etp_grid(model: Any, world: int) -> tuple[int, ...]:
    """The expert-TP degrees the search on ``world`` local ranks can price: every divisor of the world
    that splits an MoE model's expert width ((1,) for a dense model)."""
    from profilers.layers import etp_sizes

    return etp_sizes(model, tuple(t for t in range(1, world + 1) if world % t == 0))


def _sweep(mbs: tuple[int, ...], seq: int, tps: tuple[int, ...], dtype: str, pieces: tuple[str, ...],
           eps: tuple[int, ...] = (1,), etps: tuple[int, ...] = (1,), world: int = 0) -> Any:
    from profilers.layers import LayerSweep

    return LayerSweep(micro_batches=mbs, seq_lens=(seq,), tp=tps, dtype=dtype, pieces=pieces, threads=1, ep=eps,
                      etp=etps, moe_world=world)


def per_token_s(doc: dict[str, Any], layers: int, update: dict[str, Any] | None = None,
                global_batch: int | None = None) -> float:
    """Seconds per token of ``layers`` blocks (an MoE model's dense and MoE blocks) and the head, fwd +
    bwd, at the doc's largest tp-1 (ep-1) micro-batch; with ``update`` (``profilers/update_costs.measure_update``) also one micro-batch's
    gradient accumulation and the step's update shared over ``global_batch`` sequences."""
    pts = [p for p in doc["points"] if p["tp"] == 1 and p.get("ep", 1) == 1]
    b = max(p["micro_batch"] for p in pts)
    t = {p["piece"]: p["fwd_s"] + p["bwd_s"] for p in pts if p["micro_batch"] == b}
    seq = next(p["seq"] for p in pts)
    moe = (doc.get("model") or {}).get("moe")  # an MoE model: its dense layers time as ``block``, the rest ``moe``
    n_moe = layers - len(moe["dense_layers"]) if moe else 0
    per = ((layers - n_moe) * t.get("block", 0.0) + n_moe * t.get("moe", 0.0) + t.get("head", 0.0)) / (b * seq)
    if update:
        n = update["params"]
        per += update["accumulate_s_per_param"] * n / (b * seq)
        per += update["update_s_per_param"] * n / ((global_batch or b) * seq)
    return per


def _timed(model: Any, sweep: Any, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(layer profile doc, update costs) of ``sweep``, timed beside ``world - 1`` twins."""
    from profilers.layers import profile_layers
    from profilers.twins import twins
    from profilers.update_costs import measure_update

    with twins(model, sweep, world - 1):
        return profile_layers(model, "cpu", sweep), measure_update(model, sweep.dtype)


def _probe_pieces(model: Any) -> tuple[str, ...]:
    """The pieces the precision probe times: every block kind the model has, and the head."""
    from profilers.layers import model_pieces

    return tuple(p for p in model_pieces(model) if p != "embed")


def choose_precision(model: Any, seq: int, global_batch: int, dtypes: list[str], say: Any,
                     world: int = 1) -> Precision:
    """Time one block and the head at ``PROBE_MBS`` in each of ``dtypes`` (beside ``world - 1``
    twins); the fastest per token."""
    if len(dtypes) == 1:
        return Precision(dtypes[0], {}, f"precision: {dtypes[0]} (the only one every device has)")
    say(f"timing {model.name} in {', '.join(dtypes)} to pick the precision ...")
    b = min(PROBE_MBS, global_batch)
    per = {}
    for dt in dtypes:
        doc, update = _timed(model, _sweep((b,), seq, (1,), dt, _probe_pieces(model)), world)
        per[dt] = per_token_s(doc, model.layers, update, global_batch)
    best = min(per, key=per.get)
    others = ", ".join(f"{dt} {per[dt] * 1e6:,.0f}" for dt in dtypes if dt != best)
    note = (f"precision: {best}, the fastest this machine trains {model.name} in ({per[best] * 1e6:,.0f} us/token "
            f"against {others}; measured, micro-batch {b}); --dtype chooses another")
    return Precision(best, per, note)


def measure_layers(model: Any, seq: int, global_batch: int, world: int, dtype: str, storage: str, say: Any) -> int:
    """Time the model's pieces on the grid the search prices, store them; the ``layers:ID``."""
    import time

    from profilers.layers import model_pieces
    from profilers.store import save_layer_profile

    mbs, tps, eps = layer_grid(model, global_batch, world)
    etps = etp_grid(model, world)
    say(f"timing {model.name}'s layers in {dtype} (micro-batches {', '.join(map(str, mbs))}; "
        f"tp {', '.join(map(str, tps))}" + (f"; MoE block at ep {', '.join(map(str, eps))}, etp "
                                            f"{', '.join(map(str, etps))}" if model.moe else "") + ") ...")
    t0 = time.perf_counter()
    doc, update = _timed(model, _sweep(mbs, seq, tps, dtype, model_pieces(model), eps, etps, world), world)
    meta = {**(doc.get("meta") or {}), "update": update}
    if world >= 2:  # ZeRO-2/3 shard over at least two ranks: what FSDP2 adds to their step
        from profilers.fsdp_costs import measure_fsdp

        meta["fsdp"] = measure_fsdp(model, dtype)  # two ranks of their own: no twins beside them
    doc["meta"] = meta
    lid = save_layer_profile(doc, storage, label="tune")
    say(f"measured {model.name}'s layers: layers:{lid} ({time.perf_counter() - t0:.1f} s)")
    return lid
