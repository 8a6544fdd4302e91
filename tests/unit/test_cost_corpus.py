"""The cost model reproduces its pinned corpus bit for bit (tests/data/cost_corpus.json).

Every entry (a plan over a catalogue, mixed, measured-GPU or CPU cluster, with its workload,
calibration and timeline flag) is priced again and its ``predicted`` and full ``breakdown`` must
equal the stored ones exactly (float ==, no tolerance): a reshaping of ``autotune/cost`` may not
move a figure. A change that moves figures on purpose regenerates the corpus
(``python tests/data/make_cost_corpus.py``) in the same commit and names what changed and why.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"


def _generator():
    spec = importlib.util.spec_from_file_location("make_cost_corpus", DATA / "make_cost_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


GEN = _generator()
STORED = json.loads((DATA / "cost_corpus.json").read_text())["entries"]


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON values first differ (for a readable failure)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: present on one side only"
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b and type(a) is type(b) else f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("cluster_key", sorted({e["cluster"] for e in STORED}))
def test_corpus_is_reproduced_bit_identically(cluster_key):
    cluster = GEN.build_cluster(cluster_key)
    diffs = []
    for i, e in enumerate(STORED):
        if e["cluster"] != cluster_key:
            continue
        got = GEN.price(e, cluster)
        d = _first_difference(got, {"predicted": e["predicted"], "breakdown": e["breakdown"]})
        if d:
            diffs.append(f"entry {i} ({e['model']}, {e['plan']['degrees']}): {d}")
    assert not diffs, f"{len(diffs)} corpus entries moved:\n" + "\n".join(diffs[:10])


def test_corpus_spans_what_the_plan_can_say():
    """The corpus draws every schedule, recompute mode, ZeRO stage, dtype, CP layout, sequence
    parallelism, each kind of uneven share, calibrated and timeline entries, and infeasible plans."""
    from autotune.plan import CP_LAYOUTS, DTYPES, RECOMPUTE

    plans = [e["plan"] for e in STORED]
    assert {p["schedule"] for p in plans} >= {"gpipe", "1f1b", "interleaved_1f1b"}
    assert {p["recompute"] for p in plans} == set(RECOMPUTE)
    assert {p["zero_stage"] for p in plans} == {0, 1, 2, 3}
    assert {p["dtype"] for p in plans} == set(DTYPES)
    assert {p["cp_layout"] for p in plans} == set(CP_LAYOUTS)
    assert {p["sequence_parallel"] for p in plans} == {True, False}
    assert {k for p in plans for k in p.get("shares", {})} == {"layers", "tokens", "heads", "samples"}
    assert any(e["calibration"] for e in STORED) and any(e["timeline"] for e in STORED)
    assert {e["predicted"]["feasible"] for e in STORED} == {True, False}
    kinds = {GEN.build_cluster(e["cluster"]).groups[0].device.kind for e in STORED}
    assert kinds == {"cuda", "cpu"}
    assert len(STORED) >= 300
