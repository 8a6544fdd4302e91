"""Per-layer profiles: the model's real pieces timed on the device at hand.

``autotune profile --layers MODEL`` builds the runtime's own modules (``autotune/runtime/model.py``
``StageModel``: what a trial runs) for three pieces and times each forward and forward + backward
over micro-batch sizes, sequence lengths and tensor-parallel shards:

- ``embed``: the (vocabulary-parallel) embedding lookup of ``[b, s]`` token ids;
- ``block``: one decoder block (norms, q/k/v/o projections, rotary, causal SDPA, SwiGLU or GeLU MLP,
  residuals) on ``[b, s, hidden]``;
- ``head``: the final norm, the LM head and the cross-entropy, averaged to one loss;
- ``moe`` (an MoE model only; its ``block`` is then its first dense layer): its first MoE block
  (attention, router, the dispatch's permutation, the routed experts, the combine, the shared
  experts) as one EP rank of each ``ep`` degree runs it: ``moe.experts / ep`` experts taking the rows
  every EP rank would send them when all route as this one does (``shard_groups``), its ``1/tp`` of
  the tokens under tp, and at each ``etp`` the slice etp rank 0 computes of every etp rank's rows.
  The all-to-alls are not timed (the link model prices them). Each point also carries ``parts``: the
  MoE FFN's steps timed apart (``profilers/moe_parts.py``: router, dispatch, experts, combine, and
  shared where the model has shared experts; ``ffn``, the whole FFN at once, their reference), the
  terms a CPU rank's MoE block is priced from (``autotune/cost/cpu_moe.py``).

A tp shard is timed as *the shard's weights on one device*: the layers are built with a tp axis of
size ``t`` and no process group, so every weight has its shard's shape (heads / t, ffn / t, vocab / t)
and no collective runs (tp communication is priced by the link model, not here). Token ids and
targets are drawn inside the shard's vocabulary slice.

Timing follows ``profilers/timing.py``: warm-up calls thrown away, repeats in interleaved rounds over
the whole sweep, median of round medians, relative IQR spread with an ``unstable`` flag, CUDA events
on GPU (``Meter`` picks them from the device), the calling thread's CPU time on a one-thread CPU
rank. Backward is not separable from its forward's graph without re-running it, so each point times
``fwd`` and ``fwd+bwd`` and reports ``bwd_s = fwd_bwd_s - fwd_s``.

Activation memory is *measured*, on any device: the bytes of the distinct tensors autograd saves
for backward during the forward (``torch.autograd.graph.saved_tensors_hooks``, deduplicated by
storage, weights and buffers left out), the figure the cost model's activation term predicts;
parameter bytes of the piece too. Each block point says which attention ran (``attention``:
``materialized`` when a saved tensor holds the s x s scores, else ``fused``); ``--attention``
chooses it (``runtime``: whatever ``scaled_dot_product_attention`` dispatches to, as a trial runs it:
the flash kernel on CUDA and, in torch >= 2.2, on CPU too; ``materialized``: the math kernel;
``fused``: flash / memory-efficient / cuDNN only).

The result is a document (``layer_profile_doc``) that ``profilers/store.py`` keeps in
``autotune_layer_profiles`` beside the kernel profiles; ``autotune/cost/layers.py`` reads it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.errors import InputError
from autotune.specs.profiles import LAYER_DOC_KIND, LAYER_SCHEMA_VERSION, LAYER_UNITS, PIECES  # noqa: F401
from profilers.pieces import Piece as _Piece  # noqa: F401  (its old name, used by tests and benchmarks)
from profilers.pieces import SavedBytes as _SavedBytes  # noqa: F401
from profilers.timing import Meter, repeats_for

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


ATTENTION_MODES = ("runtime", "fused", "materialized")


def sdpa_backends(mode: str) -> list | None:
    """The SDPA backends ``mode`` allows (None: torch's own choice, what the runtime runs)."""
    from torch.nn.attention import SDPBackend

    if mode == "materialized":
        return [SDPBackend.MATH]
    if mode == "fused":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if mode != "runtime":
        raise InputError(f"must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}", field="--attention")
    return None


@dataclass
class LayerSweep:
    """What to measure: the grid and the repeats."""

    micro_batches: tuple[int, ...]
    seq_lens: tuple[int, ...]
    tp: tuple[int, ...]
    dtype: str = "fp32"
    rounds: int = 3
    round_s: float = 0.01
    """Target seconds per point per round (repeats sized from the warm-up call)."""
    min_repeats: int = 2
    max_repeats: int = 10
    pieces: tuple[str, ...] = PIECES
    threads: int = 1
    attention: str = "runtime"
    """Which SDPA kernels may run (``ATTENTION_MODES``)."""
    notes: list[str] = field(default_factory=list)
    ep: tuple[int, ...] = (1,)
    """EP degrees the ``moe`` piece is timed at (one shard of each)."""
    etp: tuple[int, ...] = (1,)
    """Expert-TP degrees the ``moe`` piece is timed at (etp rank 0's slice of each EP shard)."""
    moe_world: int = 0
    """The most ranks an (ep, etp) shard may fold onto (0: no limit): ``ep * etp`` beyond it is not timed."""

    def moe_shards(self) -> list[tuple[int, int]]:
        """The (ep, etp) shards the ``moe`` piece is timed at."""
        return [(e, t) for e in self.ep for t in self.etp if not self.moe_world or e * t <= self.moe_world]

    def keys(self) -> list[tuple[str, int, int, int, int, int]]:
        """Every (piece, tp, micro_batch, seq, ep, etp) point, in the order they are timed (ep = etp = 1
        but for ``moe``)."""
        return [(piece, t, b, s, e, et) for piece in self.pieces for t in self.tp for b in self.micro_batches
                for s in self.seq_lens for e, et in (self.moe_shards() if piece == "moe" else [(1, 1)])]


def model_pieces(model: Any) -> tuple[str, ...]:
    """The pieces ``profile --layers`` times of ``model``: ``PIECES``, and ``moe`` for an MoE model
    (whose ``block`` is its first dense layer: none, none timed)."""
    if getattr(model, "moe", None) is None:
        return PIECES
    dense = model.layers > model.moe_layer_count
    return tuple(p for p in PIECES if p != "block" or dense) + ("moe",)


def ep_sizes(model: Any, wanted: tuple[int, ...]) -> tuple[int, ...]:
    """The EP degrees of ``wanted`` that split an MoE model's experts evenly ((1,) for a dense model)."""
    if getattr(model, "moe", None) is None:
        return (1,)
    return tuple(e for e in wanted if e >= 1 and model.moe.experts % e == 0) or (1,)


def etp_sizes(model: Any, wanted: tuple[int, ...]) -> tuple[int, ...]:
    """The expert-TP degrees of ``wanted`` that split an MoE model's expert width evenly ((1,) for a
    dense model), as ``runtime/moe.py`` ``Expert`` requires."""
    if getattr(model, "moe", None) is None:
        return (1,)
    return tuple(e for e in wanted if e >= 1 and model.moe.expert_ffn_hidden % e == 0) or (1,)


def shard_sizes(model: Any, wanted: tuple[int, ...]) -> tuple[tuple[int, ...], list[str]]:
    """The tp degrees of ``wanted`` that split the model evenly (heads, kv heads, MLP width and the
    vocabulary all divisible, as the runtime's tp layers require), and a note per one dropped."""
    ok, notes = [], []
    for t in wanted:
        bad = [n for n, v in (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn_hidden", model.ffn_hidden),
                              ("vocab", model.vocab)) if v % t]
        if t < 1 or bad:
            notes.append(f"tp {t} skipped: does not divide {', '.join(bad) or 'anything'}")
        else:
            ok.append(t)
    return tuple(ok), notes


def seq_lens_within(model: Any, wanted: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the sequence lengths of ``wanted`` the model can take, those it cannot): a learned position
    table has ``max_positions`` rows."""
    if getattr(model, "position", "rope") != "learned":
        return tuple(wanted), ()
    return (tuple(s for s in wanted if s <= model.max_positions),
            tuple(s for s in wanted if s > model.max_positions))


def default_sweep(model: Any, device: str, dtype: str = "fp32", threads: int | None = None) -> LayerSweep:
    """CPU: a grid that takes well under a minute for ``tiny``/``small`` (3 x 3 x 2 points per
    piece); CUDA: training-sized micro-batches and sequences."""
    cpu = not device.startswith("cuda")
    if cpu:
        mbs, seqs, tps = (1, 2, 4), (64, 128, 256), (1, 2)
    else:
        mbs, seqs, tps = (1, 2, 4, 8), (512, 1024, 2048, 4096), (1, 2, 4, 8)
    tps, notes = shard_sizes(model, tps)
    seqs, too_long = seq_lens_within(model, seqs)
    notes += [f"seq {s} skipped: > max_positions({model.max_positions})" for s in too_long]
    return LayerSweep(micro_batches=mbs, seq_lens=seqs, tp=tps, dtype=dtype, notes=notes,
                      threads=threads or (1 if cpu else 1), pieces=model_pieces(model), ep=ep_sizes(model, tps),
                      etp=etp_sizes(model, tps), moe_world=max(tps))


def parse_grid(text: str | None, name: str) -> tuple[int, ...] | None:
    """``"1,2,4"`` -> (1, 2, 4); None stays None; anything else is an input error on ``--name``."""
    if text is None:
        return None
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or any(v < 1 for v in vals):
        raise InputError(f"expected a comma-separated list of positive integers, got {text!r}", field=f"--{name}")
    return tuple(sorted(set(vals)))


Progress = Callable[[int, int, str], None]


def run_layers(model: Any, device: str, sweep: LayerSweep, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Time every (piece, tp, micro_batch, seq) of ``sweep`` on ``device``; one point dict each."""
    import torch

    if sweep.dtype not in DTYPES:
        raise InputError(f"must be one of {', '.join(DTYPES)}, got {sweep.dtype!r}", field="--dtype")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda asked for but torch sees no CUDA device", field="--device")
    dtype = getattr(torch, DTYPES[sweep.dtype])
    if not sweep.tp:
        raise InputError("no tp shard size divides the model (" + "; ".join(sweep.notes) + ")", field="--tp")
    _, too_long = seq_lens_within(model, sweep.seq_lens)
    if too_long:
        raise InputError(f"{', '.join(map(str, too_long))} > max_positions({model.max_positions}) of "
                         f"model {model.name}'s learned position table", field="--seq")
    if not sweep.seq_lens:
        raise InputError("no sequence length to measure (" + "; ".join(sweep.notes) + ")", field="--seq")
    prev_threads = torch.get_num_threads()
    if not device.startswith("cuda"):
        torch.set_num_threads(sweep.threads)
    clock = "thread" if not device.startswith("cuda") and sweep.threads == 1 else "wall"
    backends = sdpa_backends(sweep.attention)
    try:
        if backends is None:
            return _measure(model, device, sweep, dtype, clock, progress)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backends):
            return _measure(model, device, sweep, dtype, clock, progress)
    except RuntimeError as e:
        if backends is not None and "No available kernel" in str(e):
            raise InputError(f"no {sweep.attention} attention kernel runs {sweep.dtype} on {device} "
                             f"({str(e).splitlines()[0]})", field="--attention") from None
        raise
    finally:
        torch.set_num_threads(prev_threads)


def _measure(model, device, sweep, dtype, clock, progress) -> list[dict[str, Any]]:
    keys = sweep.keys()
    total = len(keys) * (1 + sweep.rounds)
    done = 0
    pieces, meters, reps = {}, {}, {}
    for key in keys:  # build and warm every point once, and size its rounds
        p = pieces[key] = _Piece(key[0], model, key[1], key[2], key[3], device, dtype, ep=key[4], etp=key[5])
        calls = {"": (p.fwd, p.fwd_bwd)}
        if key[0] == "moe":  # the MoE FFN's steps apart (profilers/moe_parts.py)
            calls.update(p.moe_parts().calls())
        for part, (f, fb) in calls.items():
            for kind, fn in (("fwd", f), ("fwd_bwd", fb)):
                m = meters[key, kind, part] = Meter(fn, device=device, clock=clock)
                reps[key, kind, part] = repeats_for(m.warm(1), sweep.round_s, sweep.min_repeats, sweep.max_repeats)
        done += 1
        if progress:
            progress(done, total, f"warm {key[0]} tp{key[1]} b{key[2]} s{key[3]}"
                     + (f" ep{key[4]}" if key[4] > 1 else "") + (f" etp{key[5]}" if key[5] > 1 else ""))
    for r in range(sweep.rounds):  # interleaved rounds: a burst of load spoils one round, not a point
        for key in keys:
            for mkey, m in meters.items():
                if mkey[0] == key:
                    m.take(reps[mkey])
            done += 1
            if progress:
                progress(done, total, f"round {r + 1}/{sweep.rounds}")
    out = []
    for key in keys:
        piece, t, b, s, e, et = key
        tf, tfb = meters[key, "fwd", ""].timing(), meters[key, "fwd_bwd", ""].timing()
        saved = pieces[key].saved()
        pt = {"piece": piece, "tp": t, "micro_batch": b, "seq": s,
              "fwd_s": tf.median_s, "fwd_bwd_s": tfb.median_s, "bwd_s": max(0.0, tfb.median_s - tf.median_s),
              "spread": max(tf.spread, tfb.spread), "unstable": bool(tf.unstable or tfb.unstable),
              "clock": tf.clock, "wall_fwd_bwd_s": tfb.wall_median_s,
              "activation_bytes": saved.total, "param_bytes": pieces[key].param_bytes}
        if piece in ("block", "moe"):
            pt["attention"] = "materialized" if saved.scores else "fused"
        if piece == "moe":
            pt["ep"] = e
            if et > 1:
                pt["etp"] = et
            pt["parts"] = _parts(meters, key)
        out.append(pt)
    return out


def _parts(meters: dict, key: tuple) -> dict[str, list[float]]:
    """{step: [fwd_s, bwd_s]} of a ``moe`` point's FFN steps (``profilers/moe_parts.py``), as the
    piece's own: the median forward, and the backward as fwd+bwd less it."""
    out = {}
    for mkey in meters:
        if mkey[0] == key and mkey[1] == "fwd" and mkey[2]:
            f, fb = meters[mkey].timing().median_s, meters[key, "fwd_bwd", mkey[2]].timing().median_s
            out[mkey[2]] = [f, max(0.0, fb - f)]
    return out


def model_dict(model: Any) -> dict[str, Any]:
    """The shape fields of a ModelSpec (what a layer profile is valid for); an MoE model's experts too."""
    out = {k: getattr(model, k) for k in ("name", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                                          "activation", "tied_embeddings", "norm", "bias", "position")}
    if getattr(model, "moe", None) is not None:
        out["moe"] = model.moe.to_dict()
    return out


def layer_profile_doc(model: Any, device: str, sweep: LayerSweep, points: list[dict[str, Any]],
                      measure_s: float) -> dict[str, Any]:
    """The stored/exported document of one layer profile (``profilers/store.py``)."""
    import torch

    from profilers.worker import device_name

    return {"kind": LAYER_DOC_KIND, "schema_version": LAYER_SCHEMA_VERSION, "units": LAYER_UNITS,
            "device_kind": "cuda" if device.startswith("cuda") else "cpu", "device_name": device_name(device),
            # the kernel profiles' name for the same device (profilers/worker.py)
            "model": model_dict(model), "dtype": sweep.dtype, "origin": "measured", "source": "autotune profile --layers",
            "meta": {"threads": sweep.threads, "rounds": sweep.rounds, "torch": torch.__version__,
                     "attention": _attention_ran(points, sweep.attention), "attention_asked": sweep.attention,
                     "cores": os.cpu_count(), "measure_s": measure_s, "notes": sweep.notes,
                     "grid": {"micro_batch": list(sweep.micro_batches), "seq": list(sweep.seq_lens),
                              "tp": list(sweep.tp),
                              **({"ep": list(sweep.ep), "etp": list(sweep.etp)} if "moe" in sweep.pieces else {})}},
            "points": points}


def _attention_ran(points: list[dict[str, Any]], asked: str) -> str:
    """``fused`` or ``materialized``: what the block points' saved tensors show ran (``mixed`` when
    torch chose differently by shape)."""
    kinds = {p["attention"] for p in points if p.get("attention")}
    if not kinds:
        return asked if asked != "runtime" else "unknown"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def profile_layers(model: Any, device: str = "cpu", sweep: LayerSweep | None = None,
                   progress: Progress | None = None) -> dict[str, Any]:
    """Measure ``model``'s pieces on ``device`` and return the layer-profile document."""
    sweep = sweep or default_sweep(model, device)
    t0 = time.perf_counter()
    points = run_layers(model, device, sweep, progress)
    return layer_profile_doc(model, device, sweep, points, time.perf_counter() - t0)
