"""Which per-stage plans a default search offers (issue 40 item 4): the CLI search of a setup with
``--json``, then, of the plans it lists (best first), the best plan and the first per-stage plan of
each kind of alternative (``search_spaces._stages.KINDS``: stages of different tp, a stage whose
replicas run different tp, replicas that split the sequence with cp or hp), with its place in the
list and its tokens/s against the best's.

    python benchmarks/bench_stage_kinds.py [--model M.yaml] [--cluster C.yaml] [-s 2048] [-b 2048]

Defaults: GPT-Neo-2.7B fp16 at 2,048 tokens, global batch 2,048, on 8 A100-40GB + 8 V100-16GB
(``benchmarks/data/bench/``), in a fresh study of a temporary SQLite file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BENCH = ROOT / "benchmarks" / "data" / "bench"


def search(model: str, cluster: str, seq: int, batch: int, dtype: str) -> dict:
    """The CLI search's JSON, every layout's plans listed (``-k 1000``), in a fresh study."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "autotune", "search", "-m", model, "-c", cluster, "-s", str(seq), "-b",
               str(batch), "--dtype", dtype, "--storage", f"sqlite:///{tmp}/s.db", "-k", "1000", "--json"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(out.stdout)


def report(d: dict) -> list[str]:
    """The best plan, then the first listed per-stage plan of each combination of kinds."""
    from autotune import stages as ST
    from autotune.plan import Plan
    from search_spaces._stages import stage_kinds

    best = d["best"]["predicted"]["tokens_per_s"]
    lines = [f"best: {ST.degrees_text(d['best'])} {best:,.0f} tok/s; {d['trials']} trials, {len(d['top'])} listed"]
    seen: set[tuple[str, ...]] = set()
    for i, p in enumerate(d["top"], 1):
        if not p.get("stages"):
            continue
        stages = Plan.from_dict(p).stages
        kinds = tuple(sorted(stage_kinds(stages)))
        if kinds and kinds not in seen:
            seen.add(kinds)
            tps = p["predicted"]["tokens_per_s"]
            lines.append(f"#{i} {'+'.join(kinds)}: {ST.inline(stages)} {tps:,.0f} tok/s ({tps / best:.2f}x), "
                         f"mbs {p['micro_batch_size']} {p['schedule']} recompute {p['recompute']} "
                         f"zero {p['zero_stage']}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BENCH / "gpt-neo-2.7b.yaml"))
    ap.add_argument("--cluster", default=str(BENCH / "sailor-a100-40x8-v100-16x8.yaml"))
    ap.add_argument("-s", "--seq-len", type=int, default=2048)
    ap.add_argument("-b", "--global-batch", type=int, default=2048)
    ap.add_argument("--dtype", default="fp16")
    a = ap.parse_args()
    print("\n".join(report(search(a.model, a.cluster, a.seq_len, a.global_batch, a.dtype))))


if __name__ == "__main__":
    main()
