"""Measured layers first: a block's, the head's and the embedding's time from a per-layer profile.

A device may carry per-layer profiles (``DeviceSpec.layer_profiles``: ``autotune profile --layers``
on that device, or another planner's files through ``profile import --format``). Where one matches
the estimate (same model shape: hidden, heads, kv heads, MLP width, vocabulary, activation; the
same norm, biases and positions where the document records them; same dtype) the compute module asks here first, and only falls back to its kernel curves (a kernel
profile) or the datasheet when this says nothing. The pieces: ``block`` (one decoder layer),
``head`` (final norm, LM head, loss) and ``embed``.

Interpolation, per piece, over what was measured:

* **tp shard**: a measured shard size is used as is; between two, log-log in the shard size; outside
  the range, the nearest one scaled by its share of the work (``t0 / t``: a shard's FLOPs are 1/t of
  the layer's) for ``block`` and ``head``, unscaled for ``embed`` (its output is the whole hidden).
* **micro-batch** (per sequence length): log-log between measured micro-batches; below the smallest,
  that segment's slope (clamped to [0, 1]: a smaller batch never costs more); above the largest,
  slope 1 (a saturated device's time grows with the work).
* **sequence**: log-log between measured lengths; outside, the edge segment's slope clamped to
  [1, 2] above (between the MLP's linear and attention's quadratic growth), [0, 2] below; a profile of
  one length scales linearly (the attention share's growth is then under-priced beyond it).

The layer profile prices a piece directly only where it is the rank's work: no context or Ulysses
split (cp = hp = 1: a shard of the sequence attends differently from a shorter sequence) and even
heads. Each lookup says what priced it (``layers:ID (origin), measured | interpolated |
extrapolated``).

**One scale** (issue 25, item 7). Where the device has a matching profile but the rank's block is
not a shape it holds (cp > 1, hp > 1, uneven heads), the block is priced by the fallback (kernel
curves or datasheet) *times the measured-to-fallback ratio* on the shape both can price: the same
micro-batch and shard over the whole sequence (cp = hp = 1). Without it a plan priced partly from
measurements and partly from the (optimistic) datasheet won by the change of scale alone: 6 of 8
searches over imported profiles chose cp = 2 for that reason. The head and the embedding are
per-token work, so they are looked up at the shard's length directly. The source says which:
``datasheet x 1.37 (layers:ID (origin) at cp=hp=1, ...)``.

**Activation memory**. A point may carry ``activation_bytes`` (what ``profile --layers`` measures
with saved-tensor hooks, or what a foreign file gives): the bytes one block keeps for backward per
call. ``activation_scale`` returns measured / formula on the same shape (``memory.py``'s
``layer_activation_bytes`` without sequence parallelism, at cp = hp = 1), interpolated like the
times (log-log, micro-batch slope 1 beyond the grid, sequence slope in [1, 2]); the memory model
multiplies its formula by it, so on the measured shape the block's activation memory *is* the
measurement and on a cp/hp/sp shard the formula's shape carries it on one scale.

**Precision**. A profile of the model's shape but another precision is not used (a bf16 search is
not priced from fp32 timings); ``precision_note`` says so in one line (estimate and search print it).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autotune.errors import InputError
from autotune.specs.profiles import MOE_PIECE

SHAPE_KEYS = ("hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "activation")
ARCH_KEYS = ("norm", "bias", "position")
"""What a block is built of besides its shape (LayerNorm or RMSNorm, linear biases, learned or rotary
positions): a document that records them matches only the same; one written before they were
recorded (or by a format that does not say) matches as before."""


FSDP_KEYS = ("step_s_per_param", "microbatch_s_per_param", "update_s_per_param")


def _rates(value: Any, name: str, keys: tuple[str, ...], ref: str) -> dict[str, float]:
    """``value``'s ``keys`` as non-negative finite seconds; a one-line InputError naming the field
    otherwise (a measurement that cannot be read is not priced as if it were absent)."""
    if not isinstance(value, dict):
        raise InputError(f"must be an object with {', '.join(keys)}, got {value!r}", source=ref, field=name)
    out = {}
    for k in keys:
        v = value.get(k)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if not ok:
            raise InputError(f"must be a non-negative number of seconds, got {v!r}", source=ref, field=f"{name}.{k}")
        out[k] = float(v)
    return out


@dataclass(frozen=True)
class Lookup:
    fwd: float
    bwd: float
    source: str


def _loglog(xs: list[float], ys: list[float], x: float, lo: tuple[float, float], hi: tuple[float, float],
            above: float | None = None) -> tuple[float, bool]:
    """y at x, linear in (log x, log y); (value, exact). ``lo``/``hi``: slope clamps below/above the
    measured range; ``above`` fixes the slope above it."""
    if x in xs:
        return ys[xs.index(x)], True
    if len(xs) == 1:
        slope = hi[0] if x > xs[0] else lo[1]
        slope = above if (above is not None and x > xs[0]) else slope
        return ys[0] * (x / xs[0]) ** slope, False
    if x < xs[0]:
        k, clamp = 1, lo
    elif x > xs[-1]:
        k, clamp = len(xs) - 1, hi
    else:
        k, clamp = bisect.bisect_right(xs, x), None
    x0, x1, y0, y1 = xs[k - 1], xs[k], max(ys[k - 1], 1e-30), max(ys[k], 1e-30)
    slope = (math.log(y1) - math.log(y0)) / (math.log(x1) - math.log(x0))
    if clamp is not None:
        slope = above if (above is not None and x > xs[-1]) else min(max(slope, clamp[0]), clamp[1])
        base_x, base_y = (x0, y0) if x < xs[0] else (x1, y1)
        return base_y * (x / base_x) ** slope, False
    return y0 * (x / x0) ** slope, False


def _at_tp(rows: list[tuple[int, int, float, float]], mbs: int, seq: int) -> tuple[float, float, bool]:
    """(fwd, bwd, exact) at (mbs, seq) from one shard's rows (micro_batch, seq, fwd_s, bwd_s)."""
    seqs = sorted({r[1] for r in rows})
    per_seq = []
    exact_all = True
    for s in seqs:
        pts = sorted((r[0], r[2], r[3]) for r in rows if r[1] == s)
        bs = [float(p[0]) for p in pts]
        f, ef = _loglog(bs, [p[1] for p in pts], mbs, lo=(0.0, 1.0), hi=(1.0, 1.0), above=1.0)
        b, eb = _loglog(bs, [p[2] for p in pts], mbs, lo=(0.0, 1.0), hi=(1.0, 1.0), above=1.0)
        per_seq.append((f, b))
        exact_all = exact_all and ef and eb
    ss = [float(s) for s in seqs]
    f, ef = _loglog(ss, [p[0] for p in per_seq], seq, lo=(0.0, 2.0), hi=(1.0, 2.0))
    b, eb = _loglog(ss, [p[1] for p in per_seq], seq, lo=(0.0, 2.0), hi=(1.0, 2.0))
    return f, b, exact_all and ef and eb


class LayerTable:
    """The points of one layer profile, by piece and shard."""

    def __init__(self, doc: dict[str, Any]):
        self.ref = f"layers:{doc.get('id')}"
        self.origin = str(doc.get("origin") or "measured")
        self.rows: dict[tuple[str, int, int], dict[int, list[tuple[int, int, float, float]]]] = {}
        """By (piece, ep, etp: 1 but for an MoE model's ``moe`` piece), then tp shard; a ``moe`` point's
        FFN steps (``parts``, ``profilers/moe_parts.py``) as pieces of their own, ``moe.<step>``."""
        self.act: dict[tuple[str, int], dict[int, list[tuple[int, int, float, float]]]] = {}
        """Points with measured activation bytes (as (mbs, seq, bytes, bytes): the time rows' shape)."""
        meta = doc.get("meta") or {}
        self.update: tuple[float, float] | None = None
        """(accumulation s per parameter and micro-batch, update s per parameter and step) measured by
        ``profilers/update_costs.py`` (``tune`` stores them in ``meta["update"]``), or None."""
        if meta.get("update") is not None:
            upd = _rates(meta["update"], "meta.update", ("accumulate_s_per_param", "update_s_per_param"), self.ref)
            self.update = (upd["accumulate_s_per_param"], upd["update_s_per_param"])
        self.fsdp: dict[int, dict[str, float]] = {}
        """Per ZeRO stage (2, 3): FSDP2's per-step and per-micro-batch work per parameter of the stage
        and its sharded update per parameter of the shard, measured by ``profilers/fsdp_costs.py``
        (``tune`` stores them in ``meta["fsdp"]``); empty where the profile has none."""
        if meta.get("fsdp") is not None:
            if not isinstance(meta["fsdp"], dict):
                raise InputError(f"must be an object of ZeRO stages, got {meta['fsdp']!r}", source=self.ref,
                                 field="meta.fsdp")
            for z in ("2", "3"):
                if meta["fsdp"].get(z) is not None:
                    self.fsdp[int(z)] = _rates(meta["fsdp"][z], f"meta.fsdp.{z}", FSDP_KEYS, self.ref)
        for p in doc.get("points") or []:
            key, shard = (int(p["micro_batch"]), int(p["seq"])), (int(p.get("ep", 1)), int(p.get("etp", 1)))
            self.rows.setdefault((p["piece"], *shard), {}).setdefault(int(p["tp"]), []).append(
                (*key, float(p["fwd_s"]), float(p["bwd_s"])))
            for step, fb in (p.get("parts") or {}).items():
                pair = fb if isinstance(fb, (list, tuple)) and len(fb) == 2 else (fb, None)
                f, b = _rates(dict(zip(("fwd_s", "bwd_s"), pair, strict=True)), f"points.parts.{step}",
                              ("fwd_s", "bwd_s"), self.ref).values()
                self.rows.setdefault((f"{p['piece']}.{step}", *shard), {}).setdefault(int(p["tp"]), []).append(
                    (*key, f, b))
            if p.get("activation_bytes"):
                a = float(p["activation_bytes"])
                self.act.setdefault((p["piece"], *shard), {}).setdefault(int(p["tp"]), []).append((*key, a, a))

    def lookup_bytes(self, piece: str, mbs: float, seq: int, tp: int, ep: int = 1,
                     etp: int = 1) -> tuple[float, str] | None:
        """(activation bytes one call of ``piece`` keeps for backward, how) at (mbs, seq, tp) (a
        ``moe`` piece at its (ep, etp) shard), or None when the profile measured none. Interpolated as
        the times are; beyond the measured shards the nearest one scaled by t0 / tp (the split
        tensors dominate)."""
        shards = self.act.get((piece, ep, etp))
        if not shards:
            return None
        tps = sorted(shards)
        t0 = tp if tp in shards else min(tps, key=lambda t: abs(math.log(t) - math.log(tp)))
        a, _, exact = _at_tp(shards[t0], mbs, seq)
        if t0 != tp:
            a, exact = a * t0 / tp, False
        return a, f"{self.ref} ({self.origin}), {'measured' if exact else 'interpolated'}"

    def lookup(self, piece: str, mbs: float, seq: int, tp: int, ep: int = 1, etp: int = 1) -> Lookup | None:
        """Seconds of ``piece`` at (mbs, seq, tp), and for ``moe`` (and its steps) at the EP and
        expert-TP degrees ``ep``, ``etp`` (only those measured: a shard holds other experts and takes
        other rows, not interpolated)."""
        shards = self.rows.get((piece, ep, etp))
        if not shards:
            return None
        tps = sorted(shards)
        if tp in shards:
            f, b, exact = _at_tp(shards[tp], mbs, seq)
        elif tps[0] < tp < tps[-1]:
            k = bisect.bisect_right(tps, tp)
            t0, t1 = tps[k - 1], tps[k]
            (f0, b0, _), (f1, b1, _) = _at_tp(shards[t0], mbs, seq), _at_tp(shards[t1], mbs, seq)
            w = (math.log(tp) - math.log(t0)) / (math.log(t1) - math.log(t0))
            f = math.exp((1 - w) * math.log(max(f0, 1e-30)) + w * math.log(max(f1, 1e-30)))
            b = math.exp((1 - w) * math.log(max(b0, 1e-30)) + w * math.log(max(b1, 1e-30)))
            exact = False
        else:
            t0 = tps[0] if tp < tps[0] else tps[-1]
            f, b, _ = _at_tp(shards[t0], mbs, seq)
            scale = 1.0 if piece == "embed" else t0 / tp
            f, b, exact = f * scale, b * scale, False
        rows = shards.get(tp) or shards[tps[0]]
        inside = (min(r[0] for r in rows) <= mbs <= max(r[0] for r in rows)
                  and min(r[1] for r in rows) <= seq <= max(r[1] for r in rows) and tps[0] <= tp <= tps[-1])
        how = "measured" if exact else ("interpolated" if inside else "extrapolated")
        return Lookup(f, b, f"{self.ref} ({self.origin}), {how}")


def matches(doc: dict[str, Any], model: Any, dtype: str) -> bool:
    """Same precision, shape and build; for an MoE model the same experts where the document records
    them (its ``moe`` points were timed with those)."""
    m = doc.get("model") or {}
    moe = getattr(model, "moe", None)
    return (doc.get("dtype") == dtype and all(m.get(k) == getattr(model, k) for k in SHAPE_KEYS)
            and all(m[k] == getattr(model, k) for k in ARCH_KEYS if k in m)
            and ("moe" not in m or (moe is not None and m["moe"] == moe.to_dict())))


_TABLES: dict[int, LayerTable] = {}


def table_for(spec: Any, model: Any, dtype: str) -> LayerTable | None:
    """The first of ``spec``'s layer profiles that fits ``model`` and ``dtype`` (None: none does)."""
    for doc in getattr(spec, "layer_profiles", ()) or ():
        if matches(doc, model, dtype):
            key = id(doc)
            if key not in _TABLES:
                _TABLES[key] = LayerTable(doc)
            return _TABLES[key]
    return None


def update_time(ctx: Any) -> tuple[float, str] | None:
    """(seconds, source) of the rank's step-end work outside the layers, from the layer profile's
    measured rates; None without them (then ``data_parallel.optimizer_time`` prices the update from
    the memory bandwidth).

    * ZeRO 0/1 (``TrainOptimizer``; ``LayerTable.update``): the optimizer update over the rank's
      parameters (its tp shard of its stage), sharded from ZeRO-1 on as the runtime's AdamW is, and
      in bf16 / fp16 its micro-batches' fp32 gradient accumulation over all of them once per
      micro-batch.
    * ZeRO 2/3 (FSDP2; ``LayerTable.fsdp``, where the profile has the stage's rates): FSDP2's own work
      per step and per micro-batch over the rank's parameters (copies into and out of the
      collectives, casts, hooks, the fp32 accumulation, ZeRO-3's gathers) plus the update over the
      shard at the rate measured on DTensor shards. A profile without them prices ZeRO 2/3 as before:
      the ``update`` rate over the shard, no accumulation, FSDP2's work not charged. Under uneven
      samples per replica ZeRO-3 gathers per step, not per micro-batch: its per-micro-batch rate then
      over-charges the gathers (the hooks and accumulation stay).

    Charged at the step's end with the update (under pipelining the accumulation and the gathers
    really follow each micro-batch: the same seconds, placed later)."""
    s = ctx.step
    table = table_for(ctx.spec, s.model, s.dtype)
    if table is None:
        return None
    params = ctx.params / s.tp
    shard = s.shard_n if s.zero >= 1 else 1
    z = table.fsdp.get(s.zero) if s.zero >= 2 else None
    if z is not None:
        seconds = (z["update_s_per_param"] * params / shard + z["step_s_per_param"] * params
                   + z["microbatch_s_per_param"] * params * ctx.microbatches)
        return ctx.cf * seconds, f"{table.ref} ({table.origin}), measured update and FSDP2 work"
    if table.update is None:
        return None
    acc, up = table.update
    accumulate = acc * params * ctx.microbatches if s.zero <= 1 else 0.0
    return ctx.cf * (up * params / shard + accumulate), f"{table.ref} ({table.origin}), measured update"


def applies(ctx: Any) -> LayerTable | None:
    """The layer table for this rank when its pieces are what the profile timed (cp = hp = 1, even
    heads, causal attention over the whole sequence), else None. A sliding-window layer's attention
    (``windows.windowed``) does less work than the full layer the profile timed
    (``profilers.pieces.piece_layers`` builds a full one): it is priced as a cp/hp shard is, the
    kernel model on the profile's scale (``block_scale``, ``reconciled_block``)."""
    s = ctx.step
    if s.cp > 1 or s.hp > 1 or ctx.heads != s.model.heads // s.tp:
        return None
    if ctx.window is not None and ctx.keysum < ctx.tokens * (ctx.tokens + 1) / 2.0 and _has_full_layer(s.model):
        return None
    return table_for(ctx.spec, s.model, s.dtype)


@lru_cache(maxsize=64)
def _has_full_layer(model: Any) -> bool:
    """Whether a windowed model has a full-attention layer, the one its profile timed (else every
    layer is windowed and the profile timed a windowed one, as the rank's)."""
    return any(not model.is_window_layer(i) for i in range(model.layers))


def piece(ctx: Any, name: str) -> Lookup | None:
    """Seconds (fwd, bwd) of piece ``name`` for this rank's micro-batch, or None to fall back."""
    table = applies(ctx)
    if table is None:
        return None
    return table.lookup(name, ctx.step.mbs, ctx.tokens, ctx.step.tp)


def moe_piece(ctx: Any) -> Lookup | None:
    """Seconds (fwd, bwd) of one MoE block's compute on this rank for its micro-batch, measured at
    its EP and expert-TP degrees under even shares (``profile --layers``' ``moe`` piece: attention,
    router, permutation, this EP rank's experts on their mean load (etp rank 0's slice of every etp
    rank's rows), combine, shared experts; no exchange), or None: no such point, or a rank the
    profile cannot price (``applies``)."""
    table = applies(ctx)
    x = ctx.step.experts
    if table is None or x is None:
        return None
    return table.lookup(MOE_PIECE, ctx.step.mbs, ctx.tokens, ctx.step.tp, x.ep, x.etp)


def moe_step(ctx: Any, step: str) -> Lookup | None:
    """Seconds (fwd, bwd) of one step of this rank's MoE FFN (``profilers/moe_parts.py``: router,
    dispatch, experts, combine, shared; ``ffn``: all of them at once) for its micro-batch at its EP and
    expert-TP degrees, or None where the profile did not time it. The FFN works on the rank's tokens
    alone, so a cp or hp shard is priced too: at the micro-batch of whole sequences holding as many
    tokens (``tokens_local / seq_len``)."""
    s, x = ctx.step, ctx.step.experts
    table = table_for(ctx.spec, s.model, s.dtype)
    if table is None or x is None:
        return None
    return table.lookup(f"{MOE_PIECE}.{step}", ctx.tokens_local / s.seq_len, s.seq_len, s.tp, x.ep, x.etp)


def shard_piece(ctx: Any, name: str) -> Lookup | None:
    """``head`` or ``embed`` of a rank whose block the profile cannot price (cp/hp split, uneven
    heads): per-token work, looked up at the rank's tokens per sequence (``tokens_local / mbs``)."""
    s = ctx.step
    table = table_for(ctx.spec, s.model, s.dtype)
    if table is None or applies(ctx) is not None:
        return None
    seq = max(1, round(ctx.tokens_local / s.mbs))
    hit = table.lookup(name, s.mbs, seq, s.tp)
    return None if hit is None else Lookup(hit.fwd, hit.bwd, f"{hit.source} at the shard's {seq} tokens")


def _reference_block(ctx: Any) -> Any:
    """The fallback's ``LayerCompute`` of the block the profile can price that is nearest the
    rank's: the same device, micro-batch and tp shard over the whole sequence, all heads of the
    shard, cp = hp = 1."""
    from autotune.cost import memory as M
    from autotune.cost.compute import layer_compute

    s, seq = ctx.step, ctx.step.seq_len
    heads = s.model.heads // s.tp
    _, full, scores = M.layer_activation_bytes(
        s.model, micro_batch=s.mbs, tokens_local=seq, cp_tokens=seq, seq_len=seq, heads_local=heads, tp=s.tp,
        sequence_parallel=s.sp, recompute=s.recompute, act_bytes=s.bpe, fused_attention=ctx.spec.fused_attention())
    return layer_compute(s.model, ctx.rates, tokens=s.mbs * seq, tp=s.tp, heads_local=heads,
                         keysum=seq * (seq + 1) / 2.0, block_seq=seq, micro_batch=s.mbs, act_bytes=full - scores)


def block_scale(ctx: Any) -> tuple[float, float, str] | None:
    """(fwd ratio, bwd ratio, source) that put the fallback's block of a rank the profile cannot
    price directly on the profile's scale: measured / fallback on ``_reference_block``'s shape. None
    when the device has no matching profile or the profile prices the rank's block itself."""
    s = ctx.step
    table = table_for(ctx.spec, s.model, s.dtype)
    if table is None or applies(ctx) is not None:
        return None
    hit = table.lookup("block", s.mbs, s.seq_len, s.tp)
    if hit is None:
        return None
    key = (id(table), id(ctx.rates), ctx.spec.fused_attention(), s.mbs, s.seq_len, s.tp, s.sp, s.recompute, s.dtype,
           s.model)
    got = _SCALES.get(key)
    if got is None:
        ref = _reference_block(ctx)
        rf = hit.fwd / ref.fwd if ref.fwd > 0 else 1.0
        rb = hit.bwd / ref.bwd if ref.bwd > 0 else 1.0
        r = (hit.fwd + hit.bwd) / max(ref.fwd + ref.bwd, 1e-30)
        got = _SCALES[key] = (rf, rb, f"{ctx.rates.source} x {r:.2f} (one scale: {hit.source.split(',')[0]} "
                                      f"/ {ctx.rates.source} at cp=hp=1, seq {s.seq_len})")
    return got


_SCALES: dict[tuple, tuple[float, float, str]] = {}


def reconciled_block(ctx: Any, lc: Any) -> Lookup | None:
    """The fallback's block ``lc`` of a rank the profile cannot price directly, times
    ``block_scale``; None where that does not apply."""
    sc = block_scale(ctx)
    return None if sc is None else Lookup(lc.fwd * sc[0], lc.bwd * sc[1], sc[2])


def activation_scale(ctx: Any) -> tuple[float, str] | None:
    """(measured / formula activation bytes of a block, source) on the rank's device, from its
    layer profile: at the rank's shape where the profile holds it, else at the whole sequence
    (cp = hp = 1, no sequence parallelism: what ``profile --layers`` builds). None: no matching
    profile, or it measured no activation bytes."""
    from autotune.cost import memory as M

    s = ctx.step
    if not measures_activations(ctx.spec, s.model, s.dtype):
        return None
    table = table_for(ctx.spec, s.model, s.dtype)
    seq = ctx.tokens if applies(ctx) is not None else s.seq_len
    got = table.lookup_bytes("block", s.mbs, seq, s.tp)
    if got is None:
        return None
    _, full, _ = M.layer_activation_bytes(
        s.model, micro_batch=s.mbs, tokens_local=seq, cp_tokens=seq, seq_len=seq, heads_local=s.model.heads // s.tp,
        tp=s.tp, sequence_parallel=False, recompute="none", act_bytes=s.bpe, fused_attention=ctx.spec.fused_attention())
    ratio = got[0] / full if full > 0 else 1.0
    how = got[1] if seq == ctx.tokens and applies(ctx) is not None and not s.sp else \
        f"formula x {ratio:.2f} ({got[1].split(',')[0]} at cp=hp=1, seq {seq}, no sequence parallelism)"
    return ratio, how


def measures_activations(spec: Any, model: Any, dtype: str) -> bool:
    """Whether ``spec`` has a layer profile for ``model`` and ``dtype`` that measured a block's
    activation bytes: without one ``activation_scale`` is None on every rank of that device."""
    table = table_for(spec, model, dtype)
    return table is not None and bool(table.act.get(("block", 1, 1)))


def moe_activation_ratio(ctx: Any, formula_full: float) -> float:
    """How much an MoE layer's activations scale unlike the dense block's: (measured / formula of
    the ``moe`` piece) over ``activation_scale``'s ratio, so that ``measured_activations`` puts each
    MoE layer on its own measurement (``formula_full``: the layer's bytes without recomputation on
    this rank, attention and routed). The piece is looked up at the rank's (ep, etp) and tokens (a
    cp or hp shard at the micro-batch of whole sequences holding as many); 1 where the profile
    measured no ``moe`` bytes there."""
    s, x = ctx.step, ctx.step.experts
    table = table_for(ctx.spec, s.model, s.dtype)
    if table is None or x is None or formula_full <= 0:
        return 1.0
    mbs, seq = (s.mbs, ctx.tokens) if applies(ctx) is not None else (ctx.tokens_local / s.seq_len, s.seq_len)
    got = table.lookup_bytes(MOE_PIECE, mbs, seq, s.tp, x.ep, x.etp)
    if got is None:
        return 1.0
    dense = activation_scale(ctx)
    return got[0] / formula_full / (dense[0] if dense is not None and dense[0] > 0 else 1.0)


def measured_activations(ctx: Any, kept: float, full: float, scores: float) -> tuple[float, float]:
    """(kept, full) of ``block_activations`` on the scale of what was measured: where the rank's
    device has a layer profile with activation bytes (``profile --layers`` measures them with
    saved-tensor hooks; ``profile import`` carries a foreign file's), the formula times measured /
    formula on the nearest shape the profile holds (``layers.activation_scale``: the measurement
    itself on that shape). Recomputation keeps its rule on the scaled terms: ``selective`` drops the
    scores' share, ``full`` keeps each block's input (not scaled: the formula's input is exact)."""
    got = activation_scale(ctx)
    if got is None:
        return kept, full
    r = got[0]
    recompute = ctx.step.recompute
    if recompute == "none":
        return kept * r, full * r
    if recompute == "selective":
        return (full - scores) * r, full * r
    return kept, full * r


def precision_note(spec: Any, model: Any, dtype: str) -> str | None:
    """One line when ``spec`` holds layer profiles of ``model``'s shape, none in ``dtype``: they are
    not used (another precision is another machine), so every piece is priced by the fallback."""
    docs = getattr(spec, "layer_profiles", ()) or ()
    if not docs or table_for(spec, model, dtype) is not None:
        return None
    other = sorted({f"layers:{d.get('id')} ({d.get('dtype')})" for d in docs
                    if all((d.get("model") or {}).get(k) == getattr(model, k) for k in SHAPE_KEYS)})
    if not other:
        return None
    return (f"{spec.name}: layer profile {', '.join(other)} not used for a {dtype} plan (another precision); "
            f"its pieces are priced from the {'kernel profile' if spec.profile else 'datasheet'} alone")


def precision_notes(cluster: Any, model: Any, dtype: str) -> list[str]:
    """``precision_note`` of every device type of ``cluster`` that has one."""
    seen: dict[str, str] = {}
    for g in cluster.groups:
        note = precision_note(g.device, model, dtype)
        if note is not None:
            seen.setdefault(g.device.name, note)
    return list(seen.values())


def rank_sources(ctx: Any) -> dict[str, str]:
    """What priced each compute term of the rank of ``ctx`` (and an MoE model's ``moe`` layers), as
    ``rank.rank_cost`` does: the layer
    profile where it prices the piece, the fallback on the profile's scale (``block_scale``) or the
    profile at the shard's length (``shard_piece``) where a split keeps it from the block, else
    the fallback (the kernel profile or the datasheet, as ``Rates.source`` says)."""
    out = {}
    fallback = ctx.rates.source
    for name in ("embed", "block", "head"):
        hit = piece(ctx, name)
        if hit is None and name == "block":
            sc = block_scale(ctx)
            out[name] = sc[2] if sc is not None else fallback
            continue
        if hit is None:
            hit = shard_piece(ctx, name)
        out[name] = hit.source if hit is not None else fallback
    if ctx.step.experts is not None:  # an MoE model's MoE layers (``rank._moe_blocks``)
        hit = moe_piece(ctx)
        out[MOE_PIECE] = f"{hit.source} (ep {ctx.step.experts.ep})" if hit is not None else fallback
    return out


def measured_block(lc: Any, hit: Lookup) -> Any:
    """The kernel model's ``LayerCompute`` with its totals replaced by the measured block
    (``compute.rescaled_block``: each forward term scaled to the measured forward, backward the
    measured backward)."""
    from autotune.cost.compute import rescaled_block

    return rescaled_block(lc, hit.fwd, hit.bwd)


def predicted_pieces(plan: Any, model: Any, cluster: Any, seq_len: int, global_batch: int,
                     kernels: Any = None) -> dict[str, Lookup]:
    """What the cost model prices one micro-batch's ``embed``, ``block`` and ``head`` at on the first
    rank of ``plan`` (seconds fwd, bwd, and the source), as ``rank.rank_cost`` composes them:
    the layer profile where it applies, else the compute module's kernel or datasheet model."""
    from autotune.cost import memory as M
    from autotune.cost.compute import head_compute, layer_compute
    from autotune.cost.steps import step_context, tp_groups

    s = step_context(plan, model, cluster, seq_len, global_batch, None, kernels)
    ctx = tp_groups(s)[0][2]
    fallback = ctx.rates.source
    _, full, scores = M.block_activations(ctx)
    lc = layer_compute(s.model, ctx.rates, tokens=ctx.tokens_local, tp=s.tp, heads_local=ctx.heads,
                       keysum=ctx.keysum, block_seq=ctx.block_seq, blocks=ctx.ring, micro_batch=s.mbs,
                       act_bytes=full - scores)
    hf, hb = head_compute(s.model, ctx.rates, tokens=ctx.tokens_local, tp=s.tp)
    out = {"block": Lookup(lc.fwd, lc.bwd, fallback), "head": Lookup(hf, hb, fallback),
           "embed": Lookup(ctx.rates.memory_time(ctx.hidden_bytes), 0.0, fallback)}
    for name in out:
        hit = piece(ctx, name)
        if hit is not None:
            out[name] = hit
    return out
