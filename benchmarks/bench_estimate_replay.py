"""Per-estimate CPU over the plans a search priced, and their figures byte for byte (issue 40).

Record the ``estimate`` calls of one ``autotune search`` (run in a fresh directory, so the study is
new and every plan is priced), then replay them in the same order from cold caches in a new process,
with any tree on ``PYTHONPATH``: the process CPU seconds of the ``estimate`` calls alone, and a
digest of every answer (``predicted``, ``breakdown``, the resolved plan as JSON) to compare trees.

    python benchmarks/bench_estimate_replay.py record calls.pkl search -m llama3-70b \\
        -c benchmarks/data/bench/four-types-128.yaml -s 131072 -b 16
    PYTHONPATH=<tree> python benchmarks/bench_estimate_replay.py replay calls.pkl [--answers out.json]
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import pickle
import runpy
import sys
import time
from typing import Any


def record(out: str, argv: list[str]) -> None:
    """Run ``autotune <argv>`` with ``estimate`` wrapped to keep (plan, workload, keywords) per call."""
    import autotune.cost as package

    module = sys.modules["autotune.cost.estimate"]
    real = module.estimate
    calls: list[tuple[Any, tuple, dict]] = []

    def kept(plan, model, cluster, seq_len, global_batch, **kw):
        calls.append((plan, (model, cluster, seq_len, global_batch), kw))
        return real(plan, model, cluster, seq_len, global_batch, **kw)

    package.estimate = module.estimate = kept  # the search and the stage program import it from either

    def dump() -> None:
        with open(out, "wb") as f:
            pickle.dump(calls, f)
        print(f"recorded {len(calls)} estimates in {out}", file=sys.stderr)

    atexit.register(dump)
    sys.argv = ["autotune", *argv]
    runpy.run_module("autotune", run_name="__main__")


def replay(path: str, answers: str | None) -> None:
    from autotune.cost import estimate

    with open(path, "rb") as f:
        calls = pickle.load(f)
    texts, cpu = [], 0.0
    for plan, (model, cluster, seq_len, global_batch), kw in calls:
        try:
            t0 = time.process_time()
            e = estimate(plan, model, cluster, seq_len, global_batch, **kw)
            cpu += time.process_time() - t0
            texts.append(json.dumps([e.predicted, e.breakdown, e.plan.to_dict()], sort_keys=True, default=repr))
        except Exception as exc:  # noqa: BLE001 - a refused plan is an answer to compare too
            texts.append(f"{type(exc).__name__}: {exc}")
    n = len(calls)
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    print(f"{path}: {n} estimates, {cpu:.2f} s CPU ({1e3 * cpu / n:.2f} ms an estimate); answers' digest {digest}")
    if answers:
        with open(answers, "w", encoding="utf-8") as f:
            json.dump(texts, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("argv", nargs=argparse.REMAINDER, help="the autotune command line (search ...)")
    p = sub.add_parser("replay")
    p.add_argument("calls")
    p.add_argument("--answers", help="write every answer's JSON here (to compare two trees' files)")
    a = ap.parse_args()
    if a.what == "record":
        record(a.out, a.argv)
    else:
        replay(a.calls, a.answers)


if __name__ == "__main__":
    main()
