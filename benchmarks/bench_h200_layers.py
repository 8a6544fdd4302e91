"""The GPU datasheet model against a real GPU's layers: autotune's own pieces measured on an H200.

``benchmarks/data/h200/layers_llama3_8b.json`` is ``autotune profile --layers llama3-8b --device
cuda --mbs 1,2 --seq 2048,4096 --tp 1,2`` run on a lent H200 (2026-12-04, torch 2.11, bf16, fused
SDPA): the runtime's own decoder block and LM head, forward and forward + backward, per micro-batch,
sequence and tp shard (a tp=2 point is one shard's weights on one device, without the tp
collectives). This script prices the same pieces with the catalogue's ``H200`` entry (the
size-aware datasheet model and autotune's runtime's kernels, ``cost/kernels.RUNTIME``: what an
estimate without a layer profile uses) and prints the error per point.

Held out: no constant of the GPU model was fitted on these layer timings (``HOPPER_CLOCK`` and the
GEMM ceilings come from ``gpu_gemm.py``'s GEMM sweep on the same GPU; ``EAGER_HOST_S`` from its
per-kernel host times; ``LAUNCH``/kernel counts from the runtime's code).

    python benchmarks/bench_h200_layers.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DATA = Path(__file__).resolve().parent / "data" / "h200" / "layers_llama3_8b.json"


def rows() -> list[dict]:
    from autotune.cost.layers import predicted_pieces
    from autotune.plan import parse_inline
    from autotune.specs import load_model
    from autotune.specs.cluster import cluster_from_dict

    doc = json.loads(DATA.read_text())
    model = load_model(doc["model"]["name"])
    out = []
    for p in doc["points"]:
        if p["piece"] not in ("block", "head"):
            continue  # the embedding is a lookup of a few microseconds: host time, not the model's subject
        tp, mbs, seq = p["tp"], p["micro_batch"], p["seq"]
        cluster = cluster_from_dict({"name": "h200", "nodes": [
            {"count": 1, "devices_per_node": tp, "device": "H200",
             "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}]}, source="bench_h200_layers")
        plan = parse_inline(f"tp={tp},mbs={mbs},dtype={doc['dtype']}")
        got = predicted_pieces(plan, model, cluster, seq, mbs)[p["piece"]]
        pred = got.fwd + got.bwd
        out.append({"piece": p["piece"], "tp": tp, "mbs": mbs, "seq": seq, "measured_s": p["fwd_bwd_s"],
                    "predicted_s": pred, "error": (pred - p["fwd_bwd_s"]) / p["fwd_bwd_s"],
                    "unstable": bool(p.get("unstable"))})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args(argv)
    rs = rows()
    print(f"{'piece':6} {'tp':>3} {'mbs':>4} {'seq':>6} {'measured':>10} {'predicted':>10} {'error':>8}")
    for r in rs:
        print(f"{r['piece']:6} {r['tp']:3} {r['mbs']:4} {r['seq']:6} {r['measured_s'] * 1e3:8.2f}ms "
              f"{r['predicted_s'] * 1e3:8.2f}ms {r['error']:+8.1%}" + ("  (unstable)" if r["unstable"] else ""))
    for piece in ("block", "head"):
        e = [abs(r["error"]) for r in rs if r["piece"] == piece]
        signed = [r["error"] for r in rs if r["piece"] == piece]
        print(f"{piece}: median |error| {statistics.median(e):.1%}, worst {max(e):.1%}, "
              f"median signed {statistics.median(signed):+.1%} over {len(e)} points")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
