"""Metis (github.com/SamsungLabs/Metis) per-layer profiles.

Read from the repository: ``README.md`` ("Profile Data Guide": naming, structure, units), the loader
``data_loader.py`` (``ProfileDataLoader``: which fields the planner uses) and the examples
``profile_data_samples/DeviceType.A100_tp{1,2,4}_bs{1,2,4}.json``.

One file per (device type, tp degree, batch size), named ``DeviceType.<DEVICE>_tp<T>_bs<B>.json``
(the loader takes device, tp and batch from the name). Fields used:

- ``model.num_layers``: entries in the per-layer lists: the embedding, the transformer layers and
  the head (final norm, LM head, loss) -- 10 for the 8-layer GPT-3 example;
- ``execution_time.layer_compute_total_ms``: per layer, **milliseconds** of forward plus backward
  compute of one iteration whose micro-batch, batch and global batch are all ``B`` (the README's
  note), on one tp shard of ``T``;
- ``execution_memory.layer_memory_total_mb``: per layer, **megabytes** (torch's
  ``max_memory_reserved`` / 2^20) of activations, gradients and optimizer states (Metis sums them
  per stage: ``model/cost_estimator.py`` ``_get_demand_device_memory``): kept as
  ``memory_total_bytes``; where the parameter bytes are given too, the activation part is what is
  left after the layer's model states as this cost model counts them for the precision
  (``memory.state_bytes_per_param``, no ZeRO: Metis' profiling runs are single-replica), stored as
  ``activation_bytes`` so the memory model's weights + gradients + optimizer + activations of a
  layer add up to Metis' figure (``meta.assumed`` says so; a layer whose states exceed it keeps none);
- ``model.parameters.parameters_per_layer_bytes``: per layer, bytes of parameters: 4 bytes a
  parameter of the whole layer whatever the precision and tp (the examples' 202383360 are the
  50.6M parameters of a hidden-2048 block in fp32, the same in the tp 1, 2 and 4 files).

Metis prices forward + backward together, so the split is not in the files: forward is taken as a
third of the total (backward = 2 x forward, Narayanan et al. 2021's FLOP ratio, which Metis' cost
model also assumes for its pipeline bubbles); ``meta.assumed`` records it. Not recorded: the
sequence length (``--seq``) and the precision (``--dtype``). The device is the file name's
``DeviceType.<DEVICE>`` when that is a catalogue name, else ``--device``.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from profilers.foreign.common import ImportContext, MiB, as_mapping, document, fail, load_json, need, number

NAME = re.compile(r"^DeviceType\.(?P<device>.+?)_tp(?P<tp>\d+)_bs(?P<bs>\d+)\.json$")
FWD_SHARE = 1.0 / 3.0
"""Forward's share of a layer's forward + backward time (backward = 2 x forward)."""


def _list(v: Any, n: int, path: Path, field: str) -> list[float]:
    if not isinstance(v, list) or len(v) != n:
        raise fail(path, f"expected a list of {n} numbers (model.num_layers), got "
                         f"{len(v) if isinstance(v, list) else type(v).__name__}", field)
    return [number(x, path, f"{field}[{i}]") for i, x in enumerate(v)]


def read(paths: list[Path], ctx: ImportContext) -> dict[str, Any]:
    from autotune.cost.memory import state_bytes_per_param
    from autotune.errors import InputError
    from autotune.specs.catalogue import device_from_catalogue

    seq = need(ctx.seq, "--seq", "Metis", "the sequence length")
    dtype = need(ctx.dtype, "--dtype", "Metis", "the precision")
    states_per_param = sum(state_bytes_per_param(dtype))
    points, devices = [], set()
    for path in paths:
        m = NAME.match(path.name)
        if not m:
            raise fail(path, "Metis profiles are named DeviceType.<DEVICE>_tp<T>_bs<B>.json")
        doc = as_mapping(load_json(path), path, None, "a JSON object")
        model = as_mapping(doc.get("model"), path, "model", "an object")
        n = model.get("num_layers")
        if isinstance(n, bool) or not isinstance(n, int) or n < 3:
            raise fail(path, f"expected an integer >= 3, got {n!r}", "model.num_layers")
        if n != ctx.model.layers + 2:
            raise fail(path, f"has {n} layers (embedding + {n - 2} blocks + head); the model given has "
                             f"{ctx.model.layers} blocks", "model.num_layers")
        times = _list(as_mapping(doc.get("execution_time"), path, "execution_time", "an object")
                      .get("layer_compute_total_ms"), n, path, "execution_time.layer_compute_total_ms")
        mem_sec = doc.get("execution_memory")
        mems = (_list(mem_sec.get("layer_memory_total_mb"), n, path, "execution_memory.layer_memory_total_mb")
                if isinstance(mem_sec, dict) and mem_sec.get("layer_memory_total_mb") is not None else None)
        params = model.get("parameters", {}).get("parameters_per_layer_bytes") if isinstance(
            model.get("parameters"), dict) else None
        params = _list(params, n, path, "model.parameters.parameters_per_layer_bytes") if params is not None else None
        tp, bs = int(m["tp"]), int(m["bs"])
        for piece, idx in (("embed", [0]), ("block", list(range(1, n - 1))), ("head", [n - 1])):
            total = statistics.median(times[i] for i in idx) / 1e3
            pt = {"piece": piece, "tp": tp, "micro_batch": bs, "seq": seq, "fwd_s": total * FWD_SHARE,
                  "bwd_s": total * (1 - FWD_SHARE), "fwd_bwd_s": total}
            if mems is not None:
                pt["memory_total_bytes"] = statistics.median(mems[i] for i in idx) * MiB
            if params is not None:
                pt["param_bytes"] = statistics.median(params[i] for i in idx)
            if mems is not None and params is not None:
                left = pt["memory_total_bytes"] - pt["param_bytes"] / 4.0 / tp * states_per_param
                if left > 0:
                    pt["activation_bytes"] = left
            points.append(pt)
        devices.add(m["device"])
    device = ctx.device
    if device is None:
        if len(devices) != 1:
            raise fail(paths[0], f"files of several devices ({', '.join(sorted(devices))}); import each device's "
                                 "files on their own with --device", "--device")
        name = next(iter(devices))
        try:
            device = device_from_catalogue(name).name
        except InputError:
            raise fail(paths[0], f"device {name!r} of the file name is not a catalogue name; give it with --device",
                       "--device") from None
    assumed = [f"sequence length {seq} (--seq)", f"precision {dtype} (--dtype)",
               "forward = 1/3 of layer_compute_total_ms (backward = 2 x forward)",
               f"activation bytes = layer_memory_total_mb - parameter bytes / 4 / tp x {states_per_param:g} "
               f"(the shard's weights, gradients and Adam states in {dtype}, no ZeRO)"]
    return document("metis", ctx, device, dtype, points, [str(p) for p in paths], assumed)
