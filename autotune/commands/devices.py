"""`autotune devices`: the device catalogue with the figures the cost model uses and their sources."""

from __future__ import annotations

from typing import Any

from autotune.commands.common import JsonOpt, WideOpt, console, emit_json
from autotune.dashboard.tables import Col, fit
from autotune.units import fmt_bandwidth

HELP = "List the device catalogue: peak FLOP/s per precision, memory, bandwidths and where each figure comes from."

_DTYPES = ("bf16", "fp16", "fp8", "fp32", "fp32-strict")


def rows() -> list[dict[str, Any]]:
    """One row per catalogue entry (aliases named beside the entry they stand for)."""
    from autotune.specs.catalogue import ALIASES, CATALOGUE

    out = []
    for name, d in CATALOGUE.items():
        out.append({"name": name, "aliases": sorted(a for a, n in ALIASES.items() if n == name), "kind": d.kind,
                    "peak_flops": dict(d.peak_flops), "memory_bytes": d.memory_bytes,
                    "memory_bandwidth": d.memory_bandwidth, "interconnect": d.interconnect,
                    "intra_node_bandwidth": d.intra_node_bandwidth, "nic_bandwidth": d.nic_bandwidth,
                    "achievable_fraction": d.achievable_fraction, "sm_count": d.sm_count,
                    "framework_reserve_bytes": d.framework_reserve_bytes, "provenance": d.provenance,
                    "source": d.source, "memory_source": d.memory_source or "datasheet (decimal GB)",
                    "gemm_ceiling": {k: d.gemm_fraction(k)[0] for k in _DTYPES if k in d.peak_flops},
                    "gemm_source": d.gemm_fraction("bf16" if "bf16" in d.peak_flops else "fp16")[1],
                    "sustained_clock": d.sustained()[0], "sustained_source": d.sustained()[1]})
    return out


def command(wide: WideOpt = False, json_: JsonOpt = False) -> None:
    """List the device catalogue."""
    data = rows()
    if json_:
        emit_json({"devices": data})
        return
    cols = [Col("device", "left", 0), *(Col(k, priority={"fp32-strict": 3, "fp8": 2}.get(k, 1))
                                        for k in _DTYPES),
            Col("memory", priority=0), Col("GEMM", priority=1), Col("clock", priority=2), Col("HBM", priority=2),
            Col("intra-node", priority=2), Col("NIC", priority=3), Col("aliases", "left", 4)]
    table_rows = []
    for r in data:
        pf = r["peak_flops"]
        table_rows.append([r["name"], *(f"{pf[k] / 1e12:g}" if k in pf else "-" for k in _DTYPES),
                           f"{r['memory_bytes'] / 2**30:.1f}GiB",
                           f"{r['gemm_ceiling'].get('bf16', r['gemm_ceiling'].get('fp16', 0)):.2f}",
                           f"{r['sustained_clock']:.2f}", fmt_bandwidth(r["memory_bandwidth"]),
                           fmt_bandwidth(r["intra_node_bandwidth"]), fmt_bandwidth(r["nic_bandwidth"]),
                           ", ".join(r["aliases"]) or "-"])
    console.print(fit(console, cols, table_rows, wide=wide, title="Device catalogue: dense peak TFLOP/s per precision, "
                      "memory as the device reports it, the fraction of peak a large bf16 GEMM reaches (GEMM), "
                      "the clock a training run sustains (clock), bandwidths per device and direction",
                      caption="fp32 is TF32 where the device has it, fp32-strict the non-tensor-core peak, fp8 the FP8 "
                              "tensor peak (MXFP8 too on Blackwell: `--json` peak_flops.mxfp8); "
                              "the source of every figure: `autotune devices --json` (source, memory_source, "
                              "gemm_source, sustained_source); a device not listed can be described in "
                              "the cluster file (docs/files.md)"))
