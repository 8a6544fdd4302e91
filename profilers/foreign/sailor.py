"""Sailor (github.com/eth-easl/sailor) per-layer profiles.

Read from the repository: ``docs/PROFILING.md`` ("Model Profiling"), the writer
``third_party/Megatron-DeepSpeed/megatron/training.py`` (``args.sailor_profile`` block), the timing
hooks ``sailor/profiling/profile_utils.py``, the gatherer ``sailor/profiling/gather_profs.py`` and the
planner's reader ``sailor/Planner/sailor_planner/cpp_src/utils/read_json.cpp`` (``read_llm_profile``)
with ``training.cpp``; examples ``sailor/Planner/sailor_planner/profiles/<model>/<gpu>/profile.json``.

Two shapes are accepted:

- the gathered ``profiles/<MODEL>/<GPU>/profile.json``: ``{mbs: {tp: {layer: [fwd, bwd, update]}}}``
  (keys are strings), written by ``gather_profs.py`` from the per-run files;
- a per-run file ``profile_<MODEL>_<GPU>_<TP>_<MBS>.json`` (``training.py``): ``{"timing": {layer:
  [fwd, bwd, update]}, "memory": {layer: {"params_bytes", "act_mem_bytes", ...}}}``, tp and
  micro-batch from the file name.

Meanings and units: times in **seconds** per micro-batch (CUDA events, ``elapsed_time(...) / 1000``,
averaged after 5 warm-up iterations); ``fwd`` and ``bwd`` of that layer, ``update`` the optimizer
step of the whole model (the same number on every layer; not a layer's cost, not imported). Layer
``"0"`` is the embedding, ``"1"`` .. ``"L"`` the transformer layers (all but the first copied from
one measured layer), then the final norm (LLaMA models only, its own key) and the LM head with the
loss (``"L+1"``, or ``"L+2"`` for LLaMA). ``memory``: ``params_bytes`` the layer's parameters,
``act_mem_bytes`` the activation bytes its forward allocates for backward (tp shard, one micro-batch).
- the model description ``sailor/Planner/llm_info.json`` (``gather_profs.py`` appends to it):
  ``{MODEL: {tp: {layer: {"act_mem_floats", "act_mem_bytes", "params_bytes", ...}}}}``, the
  ``memory`` of the micro-batch-1 run of each tp (``gather_profs.py`` keeps ``mbs == "1"``); Sailor's
  planner and simulators multiply ``act_mem_floats`` by the micro-batch (``training.cpp``,
  ``simulations/runtime_simulator.py``), so each point gets ``act_mem_bytes x micro_batch`` as its
  ``activation_bytes`` (``meta.assumed`` says so). Memory only: give it with the timing files; the
  entry is the one named like the gathered profile's ``profiles/<MODEL>/`` directory, else the only
  one with the model's layer count.

What Sailor's ``act_mem_bytes`` measures (``sailor/profiling/profile_utils.py``
``take_time_and_mem_fwd``): ``torch.cuda.memory_allocated()`` after the layer's forward minus before
it, in the run's precision (Sailor's runs are fp32: ``act_mem_floats = bytes // 4``): the tensors
the forward allocated and still holds, its output included.

The files do not say the sequence length (``--seq``; Sailor's runs use the model config's, 2048 for
OPT and GPT-Neo) nor the precision (``--dtype``). The GPU comes from the directory or file name
(``A100-40`` -> catalogue ``A100-40GB``, ...) unless ``--device`` names it.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from profilers.foreign.common import (
    ImportContext,
    activation_precision,
    as_mapping,
    document,
    fail,
    load_json,
    need,
    number,
)

GPU_NAMES = {"A100-40": "A100-40GB", "A100-80": "A100-80GB", "V100-16": "V100-16GB", "V100-32": "V100",
             "H100-80": "H100-SXM", "GH-96": "GH200-96GB"}
"""Sailor's GPU directory names -> autotune catalogue names (GH200 has no catalogue entry: the
profile is stored under that name and a cluster file names the device itself)."""

MEASURED_DTYPE = "fp32"
"""The precision Sailor's profiling runs measure ``act_mem_bytes`` in (module docstring), whatever
``--dtype`` labels the imported profile with."""

RUN_FILE = re.compile(r"^profile_(?P<model>.+)_(?P<gpu>[^_]+)_(?P<tp>\d+)_(?P<mbs>\d+)\.json$")


def _pieces(layers: dict[str, Any], model_layers: int, path: Path, where: str) -> dict[str, tuple[float, float]]:
    """{embed, block, head: (fwd_s, bwd_s)} of one (mbs, tp) timing table."""
    try:
        idx = sorted(int(k) for k in layers)
    except ValueError:
        raise fail(path, "layer keys must be integers (\"0\", \"1\", ...)", where) from None
    n = len(idx)
    if idx != list(range(n)) or n not in (model_layers + 2, model_layers + 3):
        raise fail(path, f"has layers {idx[0]}..{idx[-1]} ({n} entries); a {model_layers}-layer model has "
                         f"{model_layers + 2} (embedding, layers, head) or {model_layers + 3} (LLaMA: + final norm)",
                   where)

    def fb(i: int) -> tuple[float, float]:
        row = layers[str(i)]
        if not isinstance(row, list) or len(row) < 2:
            raise fail(path, f"expected [fwd_s, bwd_s, update_s], got {row!r}", f"{where}.{i}")
        return number(row[0], path, f"{where}.{i}[0]"), number(row[1], path, f"{where}.{i}[1]")

    blocks = [fb(i) for i in range(1, model_layers + 1)]
    head = fb(n - 1)
    if n == model_layers + 3:  # LLaMA: the final RMSNorm has its own entry; it belongs to the head piece
        norm = fb(model_layers + 1)
        head = (head[0] + norm[0], head[1] + norm[1])
    return {"embed": fb(0), "block": (statistics.median(b[0] for b in blocks), statistics.median(b[1] for b in blocks)),
            "head": head}


def _points(table: dict[str, tuple[float, float]], tp: int, mbs: int, seq: int,
            memory: dict[str, Any] | None, model_layers: int) -> list[dict]:
    out = []
    for piece, (f, b) in table.items():
        pt = {"piece": piece, "tp": tp, "micro_batch": mbs, "seq": seq, "fwd_s": f, "bwd_s": b}
        if memory:
            key = {"embed": "0", "block": "2" if model_layers > 1 else "1", "head": str(len(memory) - 1)}[piece]
            m = memory.get(key)
            if isinstance(m, dict) and isinstance(m.get("act_mem_bytes"), (int, float)):
                pt["activation_bytes"] = float(m["act_mem_bytes"])
                pt["param_bytes"] = float(m.get("params_bytes") or 0.0)
        out.append(pt)
    return out


def _is_llm_info(doc: dict[str, Any]) -> bool:
    """``{MODEL: {tp: {layer: {"act_mem_bytes": ...}}}}`` (llm_info.json), not a timing profile."""
    for by_tp in doc.values():
        if not isinstance(by_tp, dict):
            return False
        for layers in by_tp.values():
            if not isinstance(layers, dict):
                return False
            return any(isinstance(v, dict) and "act_mem_bytes" in v for v in layers.values())
    return False


def _llm_info_entry(doc: dict[str, Any], path: Path, names: set[str], layers: int) -> tuple[str, dict[str, Any]]:
    """The model entry of an llm_info.json: the one named like the gathered profile's directory,
    else the only one with ``layers`` transformer layers."""
    for n in names:
        if n in doc:
            return n, doc[n]

    def n_layers(entry: Any) -> int:
        first = next(iter(entry.values()), None) if isinstance(entry, dict) else None
        return len(first) if isinstance(first, dict) else -1

    fits = [k for k, v in doc.items() if n_layers(v) in (layers + 2, layers + 3)]
    if len(fits) != 1:
        raise fail(path, f"cannot tell which model entry is this model's ({', '.join(doc)}: "
                         f"{len(fits)} with {layers} layers); import it with the model's profiles/<MODEL>/<GPU>/"
                         "profile.json")
    return fits[0], doc[fits[0]]


def _act_bytes(entry: dict[str, Any], path: Path, model: str, layers: int) -> dict[int, dict[str, float]]:
    """{tp: {piece: act_mem_bytes at micro-batch 1}} of one llm_info.json model entry."""
    out: dict[int, dict[str, float]] = {}
    for tp_key, by_layer in entry.items():
        where = f"{model}.{tp_key}"
        if not tp_key.isdigit():
            raise fail(path, f"expected tp degrees as keys, got {tp_key!r}", model)
        by_layer = as_mapping(by_layer, path, where, "an object {layer: {act_mem_bytes, ...}}")
        n = len(by_layer)
        if n not in (layers + 2, layers + 3) or any(str(i) not in by_layer for i in range(n)):
            raise fail(path, f"has {n} layer entries; a {layers}-layer model has {layers + 2} or {layers + 3}", where)
        keys = {"embed": "0", "block": "2" if layers > 1 else "1", "head": str(n - 1)}
        row = {}
        for piece, k in keys.items():
            m = as_mapping(by_layer[k], path, f"{where}.{k}", "an object {act_mem_bytes, ...}")
            row[piece] = number(m.get("act_mem_bytes"), path, f"{where}.{k}.act_mem_bytes")
        out[int(tp_key)] = row
    return out


def read(paths: list[Path], ctx: ImportContext) -> dict[str, Any]:
    seq = need(ctx.seq, "--seq", "Sailor", "the sequence length")
    dtype = need(ctx.dtype, "--dtype", "Sailor", "the precision")
    points: list[dict] = []
    gpus: set[str] = set()
    infos: list[tuple[Path, dict[str, Any]]] = []
    model_dirs: set[str] = set()
    for path in paths:
        doc = as_mapping(load_json(path), path, None, "a JSON object")
        run = RUN_FILE.match(path.name)
        if "timing" not in doc and _is_llm_info(doc):
            infos.append((path, doc))
            continue
        model_dirs.add(path.parent.parent.name)
        if "timing" in doc:  # one run: tp and micro-batch in the file name
            if not run:
                raise fail(path, "a per-run Sailor profile must be named profile_<MODEL>_<GPU>_<TP>_<MBS>.json")
            timing = as_mapping(doc["timing"], path, "timing", "an object {layer: [fwd, bwd, update]}")
            memory = doc.get("memory") if isinstance(doc.get("memory"), dict) else None
            tp, mbs = int(run["tp"]), int(run["mbs"])
            points += _points(_pieces(timing, ctx.model.layers, path, "timing"), tp, mbs, seq, memory,
                              ctx.model.layers)
            gpus.add(run["gpu"])
            continue
        if not doc:
            raise fail(path, "empty profile")
        for mbs_key, by_tp in doc.items():
            if not mbs_key.isdigit():
                raise fail(path, f"expected micro-batch sizes as keys ({{\"1\": {{tp: ...}}}}), got {mbs_key!r}")
            by_tp = as_mapping(by_tp, path, mbs_key, "an object {tp: {layer: [fwd, bwd, update]}}")
            for tp_key, layers in by_tp.items():
                if not tp_key.isdigit():
                    raise fail(path, f"expected tp degrees as keys, got {tp_key!r}", mbs_key)
                where = f"{mbs_key}.{tp_key}"
                layers = as_mapping(layers, path, where, "an object {layer: [fwd, bwd, update]}")
                points += _points(_pieces(layers, ctx.model.layers, path, where), int(tp_key), int(mbs_key), seq,
                                  None, ctx.model.layers)
        gpus.add(path.parent.name)
    if not points:
        raise fail(paths[0], "llm_info.json holds Sailor's memory only; give it with the timing files "
                             "(profiles/<MODEL>/<GPU>/profile.json)")
    assumed_mem = []
    for path, doc in infos:
        name, entry = _llm_info_entry(doc, path, model_dirs, ctx.model.layers)
        acts = _act_bytes(entry, path, name, ctx.model.layers)
        for pt in points:
            row = acts.get(pt["tp"])
            if row is not None:
                pt["activation_bytes"] = row[pt["piece"]] * pt["micro_batch"]
        assumed_mem.append(f"activation bytes: {path.name} entry {name!r} (micro-batch 1, tp "
                           f"{', '.join(map(str, sorted(acts)))}) x micro-batch, as Sailor's planner scales them")
    device = ctx.device
    if device is None:
        names = {GPU_NAMES.get(g) for g in gpus}
        if len(names) != 1 or None in names:
            raise fail(paths[0], f"cannot tell the GPU from {', '.join(sorted(gpus))} (known: "
                                 f"{', '.join(GPU_NAMES)}); give it with --device", "--device")
        device = names.pop()
    assumed = [f"sequence length {seq} (--seq)", f"precision {dtype} (--dtype)",
               "block = median over the transformer layers' entries", *assumed_mem,
               *activation_precision(points, dtype, MEASURED_DTYPE, "Sailor's runs: act_mem_floats = bytes // 4")]
    return document("sailor", ctx, device, dtype, points, [str(p) for p in paths], assumed,
                    {"activation_dtype": MEASURED_DTYPE})
