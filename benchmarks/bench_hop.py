"""The hop between pipeline stages of tp a and b on this CPU (gloo, four local processes): the whole
tensor to each receiver (what ``runtime/stages.py`` sends, ``stages.hop_targets``) against 1/b slices
gathered by the receivers (Megatron's old scatter/gather), the two alternating round by round, with
what the cost model prices for each on ``local:4`` (issue 36, "price what runs").

Per (a, b) and size: the median seconds of one hop on the slowest rank for each strategy, the
median of the rounds' whole/slices ratios, and the priced seconds: the runtime's hop as
``pipeline_parallel.hop_bytes`` counts it (``stages.hop_copies`` whole copies from the busiest
sender), the scatter/gather with the same collectives (min(a, b) pairs carrying 1/min(a, b), then
the receivers' all-gather). Both priced on ``local:4`` as the catalogue has it (the alpha-beta
formulas; a profiled CPU prices with its measured gloo table instead, ``cost/cpu.GlooTable``). The
timed code is tests/distributed/_hop_targets.py (the test's).

    python benchmarks/bench_hop.py [--rounds 10] [--sizes 4096,65536,1048576,4194304,16777216]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the spawned workers import the job from here
PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 3), (3, 1)]


def priced(a: int, b: int, nbytes: int) -> tuple[float, float]:
    """(the runtime's whole send, the scatter/gather) in seconds, on local:4's link and collectives."""
    from autotune import stages as ST
    from autotune.cost import comm as C
    from autotune.cost.collectives import collectives_for
    from autotune.specs import local_cluster

    cluster = local_cluster(4)
    topo = C.topology(cluster)
    link = topo.node_link(0, 0)
    k = collectives_for(cluster.devices[0].spec)
    whole = k.p2p(link, nbytes * ST.hop_copies(a, b))
    slices = k.p2p(link, nbytes / min(a, b)) + k.all_gather(link, b, nbytes)
    return whole, slices


def main() -> None:
    from autotune.runtime.launcher import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sizes", default="4096,65536,1048576,4194304,16777216")
    args = ap.parse_args()
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; gloo, 4 processes, {args.rounds} rounds")
    print(f"{'a->b':5} {'bytes':>9} {'whole ms':>9} {'slices ms':>9} {'ratio':>6}  {'priced whole':>12} {'slices':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        res = launch("_hop_targets:hop_times", {"pairs": PAIRS, "bytes": size, "rounds": args.rounds}, 4,
                     device="cpu", timeout_s=900)
        assert res.failure is None, res.failure
        for r in res.results[0]:
            pw, ps = priced(r["a"], r["b"], r["bytes"])
            print(f"{r['a']}->{r['b']:<2} {r['bytes']:>9} {r['whole_s'] * 1e3:9.3f} {r['slices_s'] * 1e3:9.3f} "
                  f"{r['ratio']:6.2f}  {pw * 1e3:12.3f} {ps * 1e3:8.3f}")


if __name__ == "__main__":
    main()
