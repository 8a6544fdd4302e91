"""Activation memory of one block: the cost model's counts against what was measured.

1. **This machine, the runtime's own block** (``autotune/runtime/model.py``), measured as
   ``profile --layers`` does (torch's saved-tensor hooks, ``profilers/layers.py``) with fused SDPA
   (the flash kernel, what a trial runs) and materialised SDPA (the math kernel), fp32 and bf16,
   against ``cost/runtime_activations.py`` (the runtime's count, term by term) and
   ``cost/memory.py``'s Korthikanti et al. count (Megatron's layer).
2. **Sailor's published figures** (``benchmarks/data/sailor/llm_info.json``, MIT: OPT-350M and
   GPT-Neo-2.7B, fp32, seq 2048, micro-batch 1, tp 1, materialised attention on A100/V100) against the
   Korthikanti count, with the count re-done term by term (docs/validation.md explains the gap).

Usage: python benchmarks/bench_activations.py [--seq 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from autotune.cost.memory import layer_activation_bytes
from autotune.cost.runtime_activations import runtime_block_bytes
from autotune.specs.model import load_model
from profilers.layers import _Piece

DATA = Path(__file__).with_name("data")
DT = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}


def korthikanti(model, b, s, e, fused, tp=1):
    return layer_activation_bytes(model, micro_batch=b, tokens_local=s, cp_tokens=s, seq_len=s,
                                  heads_local=model.heads // tp, tp=tp, sequence_parallel=False, recompute="none",
                                  act_bytes=e, fused_attention=fused)[0]


def runtime_table(seq: int) -> None:
    print(f"== this machine: one runtime block, torch {torch.__version__}, seq {seq}, micro-batch 1 and 2 ==")
    print(f"{'model':8} {'dtype':5} {'tp':>2} {'mbs':>3} {'attention':13} {'torch saved':>12} "
          f"{'runtime count':>14} {'Korthikanti':>12}")
    for name in ("small", "tiny"):
        m = load_model(name)
        for dtype, (tdt, e) in DT.items():
            for t in (1, 2):
                for b in (1, 2):
                    p = _Piece("block", m, t, b, seq, "cpu", tdt)
                    for fused in (True, False):
                        with sdpa_kernel([SDPBackend.FLASH_ATTENTION] if fused else [SDPBackend.MATH]):
                            got = p.saved().total
                        rt = runtime_block_bytes(m, micro_batch=b, seq=seq, tp=t, act_bytes=e, fused_attention=fused,
                                                 on_cpu=True)
                        k = korthikanti(m, b, seq, e, fused, t)
                        print(f"{name:8} {dtype:5} {t:>2} {b:>3} {'fused' if fused else 'materialized':13} "
                              f"{got:>12,} {rt / got - 1:>+13.1%} {k / got:>11.2f}x")


def sailor_table() -> None:
    info = json.loads((DATA / "sailor" / "llm_info.json").read_text())
    print("\n== Sailor's measured act_mem_bytes per layer (fp32, seq 2048, micro-batch 1, tp 1, materialised) ==")
    print(f"{'model':12} {'Sailor':>12} {'Korthikanti':>12} {'ratio':>6}   in fp32 sbh units: "
          "Sailor = k x (a s / h) + rest")
    for key, yml in (("OPT-350", "opt-350m.yaml"), ("GPT-Neo-2.7", "gpt-neo-2.7b.yaml")):
        m = load_model(str(DATA / yml))
        s = 2048
        got = info[key]["1"]["2"]["act_mem_bytes"]
        k = korthikanti(m, 1, s, 4, False)
        sbh4 = s * m.hidden * 4
        as_h = m.heads * s / m.hidden
        units = got / sbh4
        print(f"{key:12} {got:>12,} {k:>12,.0f} {k / got:>5.2f}x   {units:.1f} units, a s / h = {as_h:g}: "
              f"one score tensor leaves {units - as_h:.1f} (Korthikanti: 17 + 2.5 x {as_h:g} = {17 + 2.5 * as_h:g})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runtime_table(args.seq)
    sailor_table()


if __name__ == "__main__":
    main()
