"""How much of autotune's plan space each framework can express, and what the nearest expressible
plan costs when it cannot (predicted by autotune.cost when that is built).

Enumerates every factorisation dp*pp*cp*hp*tp of a 16-device cluster (2 nodes x 8 H100) for
Llama-3-8B at 8k tokens, batch 64, with ZeRO 0/1/3, each in its even form and with one uneven share
(layers, tokens, heads or samples moved by one unit), and exports each to every target. Prints, per
target: plans accepted, refused with a nearest plan, refused without one, the median predicted
slowdown of the nearest plan, and the time to export / to find the nearest plan.

    python benchmarks/bench_apply.py
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from autotune.errors import InputError
from autotune.export import EXPORTERS, ExportRefused, export
from autotune.export.common import ExportContext, predict
from autotune.plan import Degrees, Plan
from autotune.specs.cluster import load_cluster
from autotune.specs.model import PRESETS

WORLD, SEQ, BATCH = 16, 8192, 64


def factorisations(n: int, k: int):
    if k == 1:
        yield (n,)
        return
    for f in range(1, n + 1):
        if n % f == 0:
            for rest in factorisations(n // f, k - 1):
                yield (f, *rest)


def shifted(v: tuple[int, ...], unit: int) -> tuple[int, ...] | None:
    if len(v) < 2 or v[-1] - unit < unit:
        return None
    return (v[0] + unit, *v[1:-1], v[-1] - unit)


def plans(model, cluster):
    for dp, pp, cp, hp, tp in factorisations(WORLD, 5):
        for zero in (0, 1, 3):
            try:
                base = Plan(degrees=Degrees(dp=dp, pp=pp, cp=cp, hp=hp, tp=tp), zero_stage=zero,
                            sequence_parallel=tp > 1).resolve(model, cluster, SEQ, BATCH)
            except InputError:
                continue
            yield "even", base
            sh = base.shares
            for name, unit in (("layers", 1), ("tokens", base.token_granule()), ("heads", 1),
                               ("samples", base.micro_batch_size)):
                v = shifted(getattr(sh, name), unit)
                if v is None:
                    continue
                try:
                    p = base.replace(shares=dataclasses.replace(sh, **{name: v}),
                                     num_microbatches=None).resolve(model, cluster, SEQ, BATCH)
                except InputError:
                    continue
                yield f"uneven {name}", p


def main() -> None:
    model = PRESETS["llama3-8b"]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "c.yaml"
        f.write_text(yaml.safe_dump({"name": "2xH100x8", "nodes": [{"count": 2, "devices_per_node": 8,
                                                                  "device": "H100-SXM"}]}))
        cluster = load_cluster(str(f))
    ctx = ExportContext(model=model, cluster=cluster, seq_len=SEQ, global_batch=BATCH)
    all_plans = list(plans(model, cluster))
    try:
        import autotune.cost  # noqa: F401
        has_cost = True
    except ImportError:
        has_cost = False
    print(f"{len(all_plans)} plans ({sum(k == 'even' for k, _ in all_plans)} even) for {model.name}, "
          f"seq {SEQ}, batch {BATCH}, {cluster.name}; cost model: {'yes' if has_cost else 'not built'}")
    print(f"{'target':<11} {'accepted':>8} {'nearest':>8} {'none':>5} {'slowdown':>9} {'export ms':>9} "
          f"{'refuse ms':>9}  most common refusal")
    for name in EXPORTERS:
        ok = near = none = 0
        slow, t_ok, t_ref = [], [], []
        why: dict[str, int] = {}
        for _, p in all_plans:
            t0 = time.perf_counter()
            try:
                export(p, ctx, name)
                ok += 1
                t_ok.append(time.perf_counter() - t0)
            except ExportRefused as e:
                t_ref.append(time.perf_counter() - t0)
                for r in e.reasons:
                    key = r.split(":")[0]
                    why[key] = why.get(key, 0) + 1
                if e.nearest is None:
                    none += 1
                    continue
                near += 1
                if has_cost and e.nearest.predicted:
                    orig, _ = predict(p, ctx)
                    a, b = orig.predicted.get("tokens_per_s"), e.nearest.predicted.get("tokens_per_s")
                    if a and b:
                        slow.append(a / b)
        top = max(why.items(), key=lambda kv: kv[1])[0] if why else "-"
        med = f"{statistics.median(slow):.3f}x" if slow else "n/a"
        ms = lambda xs: f"{1000 * statistics.median(xs):.2f}" if xs else "-"  # noqa: E731
        print(f"{name:<11} {ok:>8} {near:>8} {none:>5} {med:>9} {ms(t_ok):>9} {ms(t_ref):>9}  {top[:60]}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
