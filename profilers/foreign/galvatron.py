"""Hetu-Galvatron (github.com/PKU-DAIR/Hetu-Galvatron) per-layer profiles.

Read from the repository: the profiler ``galvatron/core/profiler/model_profiler.py``
(``_process_computation_data``, ``_process_memory_data``, ``_process_single_sequence_config``), the
timer ``galvatron/core/profiler/runtime_profiler.py`` (``_process_time_results``), the writer
``galvatron/core/profiler/utils.py`` (``save_profiled_time``), the cost model's
``galvatron/core/cost_model/cost_model_args.py`` (``bct_fct_coe = 2``) and the examples
``galvatron/models/gpt/configs/computation_profiling_bf16_llama2-7b_all.json`` and
``memory_profiling_bf16_llama2-7b_all.json``.

**Computation** file ``computation_profiling_<dtype>_<model>_<unit>.json``, a flat object:

- ``layernum[N]_bsz<B>_seq<S>``: **milliseconds** of a forward-only iteration (``profile_forward``:
  ``forward_only=True``) of an N-layer model at batch B (CUDA events, mean after warm-up, 3-sigma
  filtered) -- the raw runs, not imported;
- ``layertype_<i>_bsz<B>_seq<S>``: their per-layer, **per-sample** forward time in ms, (time of the
  larger model - time of the smaller) / B / (layers added), what Galvatron's search uses;
- ``layertype_other_bsz<B>_seq<S>``: the rest of the forward per sample in ms (embedding, final
  norm, LM head and loss together).

Imported: the block at micro-batch B takes ``layertype_0 x B / 1000`` s forward and, as Galvatron's
own cost model assumes (``bct_fct_coe``), twice that backward; ``layertype_other`` goes to the
``head`` piece (the embedding is in it; no ``embed`` point is written, so the cost model prices the
lookup from its kernel model). Models with several layer types (encoder-decoder) are refused.

**Memory** file ``memory_profiling_<dtype>_<model>_<unit>.json``: ``layertype_0[_sp]`` ->
``{seq: {"parameter_size": MB, "tp_activation_per_bsz_dict": {tp: MB, "checkpoint": MB}}}``, in
**MiB** (``torch.cuda.max_memory_allocated`` / 2^20): ``parameter_size`` one layer's parameters in
fp32 (param count x 4 bytes), the activation of one layer per sample at each tp degree, and with full
recomputation (``checkpoint``); ``other_memory_pp_off[_sp]`` -> ``{seq: {"model_states": {tp: MB},
"activation": {tp: MB}}}`` for the embedding and head. The per-tp block activation (bytes per
sample) goes to ``meta.memory``; the tp-1 one also onto the tp-1 block points as ``activation_bytes``
(x micro-batch). The raw ``<pp>_<tp>_<dp>[_c][_vtp][_sp]`` run tables are not imported.

The precision is the file name's (``--dtype`` overrides); the device is not recorded (``--device``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from profilers.foreign.common import (
    ImportContext,
    MiB,
    activation_precision,
    as_mapping,
    document,
    fail,
    load_json,
    need,
    number,
)

TIME_KEY = re.compile(r"^layertype_(?P<type>\d+|other)_bsz(?P<bsz>\d+)_seq(?P<seq>\d+)$")
RAW_KEY = re.compile(r"^layernum\[[\d,]+\]_bsz\d+_seq[\d,]+$")
FILE_DTYPE = re.compile(r"^(?:computation|memory)_profiling_(?P<dtype>bf16|fp16|fp32)_")
BWD_PER_FWD = 2.0
"""Galvatron's ``bct_fct_coe``: backward compute = 2 x forward."""


def _computation(doc: dict, path: Path) -> list[dict]:
    points, types = [], set()
    for key, val in doc.items():
        m = TIME_KEY.match(key)
        if not m:
            if RAW_KEY.match(key):
                continue
            raise fail(path, f"unexpected key {key!r} (expected layertype_<i>_bsz<B>_seq<S> or "
                             "layernum[N]_bsz<B>_seq<S>)")
        types.add(m["type"])
        b, s = int(m["bsz"]), int(m["seq"])
        per_sample_s = number(val, path, key) / 1e3
        fwd = per_sample_s * b
        points.append({"piece": "head" if m["type"] == "other" else "block", "tp": 1, "micro_batch": b, "seq": s,
                       "fwd_s": fwd, "bwd_s": BWD_PER_FWD * fwd, "layertype": m["type"]})
    if types - {"0", "other"}:
        raise fail(path, f"layer types {', '.join(sorted(types - {'other'}))}: only single-layer-type "
                         "(decoder-only) profiles can be imported")
    if "0" not in types:
        raise fail(path, "no layertype_0_bsz<B>_seq<S> entries: run Galvatron's profiler with "
                         "--profile_type computation and process the results first")
    for p in points:
        del p["layertype"]
    return points


def _memory(doc: dict, path: Path) -> dict[str, Any]:
    """{seq: {"block_param_bytes", "block_activation_bytes_per_sample": {tp: bytes},
    "block_checkpoint_bytes_per_sample", "other": {...}}}."""
    key = "layertype_0_sp" if "layertype_0_sp" in doc else "layertype_0"
    if key not in doc:
        raise fail(path, "no layertype_0 (or layertype_0_sp) entry: process Galvatron's memory profile first")
    if any(re.match(r"^layertype_[1-9]", k) for k in doc):
        raise fail(path, "several layer types: only decoder-only profiles can be imported")
    out: dict[str, Any] = {"sequence_parallel": key.endswith("_sp")}
    for seq, entry in as_mapping(doc[key], path, key, "an object {seq: {...}}").items():
        where = f"{key}.{seq}"
        if not seq.isdigit():
            raise fail(path, f"expected sequence lengths as keys, got {seq!r}", key)
        entry = as_mapping(entry, path, where, "an object")
        acts = as_mapping(entry.get("tp_activation_per_bsz_dict"), path, f"{where}.tp_activation_per_bsz_dict",
                          "an object {tp: MB}")
        per_tp = {}
        for tp, mb in acts.items():
            if tp == "checkpoint":
                continue
            if not tp.isdigit():
                raise fail(path, f"expected tp degrees or 'checkpoint' as keys, got {tp!r}",
                           f"{where}.tp_activation_per_bsz_dict")
            per_tp[int(tp)] = number(mb, path, f"{where}.tp_activation_per_bsz_dict.{tp}") * MiB
        out[seq] = {"block_param_bytes_fp32": number(entry.get("parameter_size"), path, f"{where}.parameter_size") * MiB,
                    "block_activation_bytes_per_sample": per_tp,
                    "block_checkpoint_bytes_per_sample": number(acts.get("checkpoint", 0.0), path,
                                                                f"{where}.tp_activation_per_bsz_dict.checkpoint") * MiB}
    return out


def read(paths: list[Path], ctx: ImportContext) -> dict[str, Any]:
    device = need(ctx.device, "--device", "Galvatron", "the GPU they were measured on")
    points: list[dict] = []
    memory: dict[str, Any] = {}
    dtypes, mem_dtypes = set(), set()
    for path in paths:
        doc = as_mapping(load_json(path), path, None, "a JSON object")
        m = FILE_DTYPE.match(path.name)
        if m:
            dtypes.add(m["dtype"])
        if any(TIME_KEY.match(k) or RAW_KEY.match(k) for k in doc):
            points += _computation(doc, path)
        elif any(k.startswith("layertype_0") or k.startswith("other_memory") for k in doc):
            memory.update(_memory(doc, path))
            if m:
                mem_dtypes.add(m["dtype"])
        else:
            raise fail(path, "neither a Galvatron computation profile (layertype_0_bsz<B>_seq<S> keys) nor a "
                             "memory profile (layertype_0 key)")
    if not points:
        raise fail(paths[0], "no computation profile among the files (computation_profiling_*.json): "
                             "times are what the cost model needs")
    if ctx.dtype is None and len(dtypes) != 1:
        raise fail(paths[0], "cannot tell the precision from the file names; give it with --dtype", "--dtype")
    dtype = ctx.dtype or dtypes.pop()
    for p in points:
        acts = (memory.get(str(p["seq"])) or {}).get("block_activation_bytes_per_sample") or {}
        if p["piece"] == "block" and 1 in acts:
            p["activation_bytes"] = acts[1] * p["micro_batch"]
    measured = mem_dtypes.pop() if len(mem_dtypes) == 1 else None
    assumed = [f"backward = {BWD_PER_FWD:g} x forward (Galvatron's bct_fct_coe)",
               "embedding timed inside layertype_other (head piece)",
               *activation_precision(points, dtype, measured, "the memory file's name")]
    return document("galvatron", ctx, device, dtype, points, [str(p) for p in paths], assumed,
                    {"memory": {s: {**v, "block_activation_bytes_per_sample":
                                    {str(k): x for k, x in v["block_activation_bytes_per_sample"].items()}}
                                if isinstance(v, dict) else v for s, v in memory.items()}})
