"""The short, JSON-able summary of a stored profile that `autotune profile` and `profile show` print.

Units follow the design's `profile --json` shape: ``links.p2p`` is a matrix in GB/s (null on the
diagonal), latencies in microseconds (``p2p_latency_us``); everything else keeps the store's
base units (FLOP/s, bytes, bytes/s, seconds) as the field names say.
"""

from __future__ import annotations

from typing import Any


def _scale(m: list[list[Any]] | None, f: float) -> list[list[Any]]:
    return [[(v * f if isinstance(v, (int, float)) else None) for v in row] for row in (m or [])]


def summarize_profile(doc: dict[str, Any]) -> dict[str, Any]:
    """From ``store.load_profile``'s document."""
    run = doc["run"]
    compute = {}
    for rank, fit in sorted(doc["fits"]["compute"].items(), key=lambda kv: int(kv[0])):
        attn = {}
        for hd, a in ((fit.get("attention") or {}).get("by_head_dim") or {}).items():
            attn[hd] = {"fwd_flops_per_s": a["fwd"]["flops_per_s"], "bwd_flops_per_s": a["bwd"]["flops_per_s"],
                        "points": a["points"]}
        compute[rank] = {
            "device_name": fit.get("device_name"),
            "emulated_slowdown": fit.get("emulated_slowdown"),
            "gemm_peak_flops_per_s": {dt: g["peak_flops_per_s"] for dt, g in (fit.get("gemm") or {}).items()},
            "gemm_best_flops_per_s": {dt: g["best_flops_per_s"] for dt, g in (fit.get("gemm") or {}).items()},
            "gemm_unsupported": fit.get("gemm_unsupported") or {},
            "attention": attn,
            "memory": fit.get("memory") or {},
            "overheads": {k: v for k, v in (fit.get("overheads") or {}).items() if k in ("gemm_call_s", "op_s")},
        }
    links = doc["fits"].get("links") or {}
    unstable = [{"rank": s["rank"], "kind": s["kind"], "params": s["params"], "spread": s["timing"]["spread"]}
                for s in doc["samples"] if s["timing"].get("unstable")]
    return {
        "id": run["id"], "label": run["label"], "created_at": run["created_at"], "device": run["device_kind"],
        "device_name": run["device_name"], "nproc": run["nproc"], "hosts": run["hosts"], "quick": run["quick"],
        "emulated": run["emulated"], "origin": run["origin"], "wall_s": run["wall_s"], "measure_s": run["measure_s"],
        "versions": run["versions"],
        "compute": compute,
        "links": {
            "p2p": _scale(links.get("p2p_bandwidth"), 1e-9),
            "p2p_latency_us": _scale(links.get("p2p_latency"), 1e6),
            "alpha_beta": links.get("alpha_beta") or {},
            "collectives": links.get("collective_table") or [],
        },
        "unstable": unstable,
        "samples": len(doc["samples"]),
    }
