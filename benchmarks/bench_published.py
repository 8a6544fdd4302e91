"""Predicted vs published: large training runs whose authors published their configuration and their
step time (or throughput), priced by ``autotune estimate`` with the runtime that ran them.

Every row names its source (paper and table, or report, with the place the figure sits), the
configuration as published (model, devices, tp/pp/dp/cp, micro-batch, global batch, sequence,
recomputation, ZeRO), and the published figure; where a configuration item is not stated in the
source the row says what was assumed (``assumed``). The script prints, per row, the published and
the predicted step time and the signed error ((predicted - published) / published), then the median
and worst absolute error over the rows no constant saw and over the rows that chose constants.

**Held out by construction.** The cost model's GPU prices rest on figures measured elsewhere (GEMM
ceilings from cuBLAS measurements, attention from FlashAttention's, host time per kernel from
benchmarks/gpu_gemm.py: the catalogue and ``autotune/cost/kernels.py`` cite each). The constants
fitted on published runs, and the rows that chose them, are ``FITTED`` below; every other row is
held out: no constant was chosen while looking at it. Two well-known tables are this project's own
held-out check and appear nowhere here (Narayanan et al. 2021, Table 1; Korthikanti et al. 2022,
Tables 3-5).

Usage: python benchmarks/bench_published.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from autotune.cost.estimate import estimate
from autotune.plan import parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import model_from_dict

SOURCES = {
    "mosaic": "MosaicML llm-foundry, scripts/train/benchmarking/README.md (MPT Training Benchmarks; tables "
              "'H100 80GB BF16', 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)', 'A100 40GB with 1600 "
              "Gbps ...'; commit 061f2c7c): columns GlobalBatchSize (T) and Throughput (T/s)",
    "mtnlg": "Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', section 2.4: "
             "global batch 1920 on 280 / 350 / 420 DGX A100 servers, 60.1 / 50.2 / 44.4 s per iteration; "
             "8-way tensor and 35-way pipeline parallelism",
    "bloom": "BigScience, bigscience/train/tr11-176B-ml/chronicles.md (iteration 12695 log line: 'elapsed time "
             "per iteration (s): 105.22 | global batch size: 2048'); README.md there: TP 4, PP 12, DP 8 on "
             "384 A100 80GB, MICRO_BATCH_SIZE=2, NLAYERS=70, NHIDDEN=14336, NHEADS=112, SEQ_LEN=2048, vocab "
             "250,680, embeddings partitioned as pipeline stages ('pp rank 0: [embed | 5 transformer blocks]')",
    "torchtitan": "pytorch/torchtitan docs/performance.md (64 A100 80GB, FSDP2, tables 'Llama 3 performance "
                  "numbers' and 'Llama 2 performance numbers': WPS per GPU)",
    "llama3": "Llama Team 2024, 'The Llama 3 Herd of Models', Table 4 (405B on H100-80GB, seq 8192, 16M tokens "
              "per batch): 8,192 GPUs TP8 CP1 PP16 DP64: 430 TFLOPs/GPU; 16,384 GPUs TP8 CP1 PP16 DP128: 400",
}

DGX_A100 = {"devices_per_node": 8, "device": "A100-80GB", "intra_node": {"bandwidth": "300GB/s", "latency": "3us"}}
UNFUSED_ATTENTION = {"attention": "materialized"}
"""Runs before FlashAttention (2022-05): Megatron's fused scale-mask-softmax still stores the s x s scores."""


def _mpt(d: int, layers: int, heads: int, seq: int) -> dict[str, Any]:
    """MPT as the benchmark ran it (llm-foundry yamls mpt-*.yaml): LayerNorm without biases, GeLU MLP
    of 4x, tied embeddings, vocab 50368, learned positions (the table's NumParams grow by seq x d)."""
    return {"name": f"mpt-d{d}", "layers": layers, "hidden": d, "heads": heads, "ffn_hidden": 4 * d, "vocab": 50368,
            "activation": "gelu", "norm": "layernorm", "position": "learned", "max_positions": seq,
            "tied_embeddings": True, "bias": False}


MPT = {"1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
       "30b": (7168, 48, 64), "70b": (8192, 80, 64)}
LLAMA2_13B = {"name": "llama2-13b", "layers": 40, "hidden": 5120, "heads": 40, "ffn_hidden": 13824, "vocab": 32000}
LLAMA2_70B = {"name": "llama2-70b", "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672,
              "vocab": 32000}
LLAMA3_70B = dict(LLAMA2_70B, name="llama3-70b", vocab=128256)
LLAMA3_405B = {"name": "llama3-405b", "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
               "ffn_hidden": 53248, "vocab": 128256}
MTNLG = {"name": "mt-nlg-530b", "layers": 105, "hidden": 20480, "heads": 128, "ffn_hidden": 81920, "vocab": 51200,
         "activation": "gelu", "norm": "layernorm", "position": "learned", "max_positions": 2048, "bias": True}
BLOOM = {"name": "bloom-176b", "layers": 70, "hidden": 14336, "heads": 112, "ffn_hidden": 57344, "vocab": 250880,
         "activation": "gelu", "norm": "layernorm", "position": "rope", "tied_embeddings": True, "bias": True}


@dataclass
class Row:
    name: str
    source: str
    where: str
    """The table row / log line the figure is read from."""
    model: dict[str, Any]
    nodes: list[dict[str, Any]]
    inter_node: str
    """Per-device inter-node bandwidth."""
    plan: str
    seq: int
    batch: int
    """Global batch in sequences."""
    published_step_s: float | None
    """Seconds per step as published (None: derived from ``extra``'s throughput, see ``published``)."""
    target: str
    """Who ran it: the runtime whose kernel costs price it (``targets.kernel_costs``)."""
    published_as: str = ""
    assumed: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _mosaic(size: str, gpu: str, n: int, seq: int, mbs: int, ga: int, ac: bool, tput: float, nic: str) -> Row:
    d, layers, heads = MPT[size]
    gbs = mbs * ga * n
    dev = {"h100": "H100-SXM", "a100_80gb": "A100-80GB", "a100_40gb": "A100-40GB"}[gpu]
    per_node = min(8, n)
    return Row(name=f"MPT-{size} {gpu} x{n} s{seq}", source="mosaic",
               where=f"{size} | {seq} | {n} | {gpu} ... MicroBatchSize {mbs} | GradAccum {ga} | Throughput (T/s) "
                     f"{tput:g} | Activation Checkpointing {ac}",
               model=_mpt(d, layers, heads, seq),
               nodes=[{"count": n // per_node, "devices_per_node": per_node, "device": dev,
                       "intra_node": {"bandwidth": "450GB/s" if dev.startswith("H100") else "300GB/s"}}],
               inter_node=nic, plan=f"dp={n},zero=3,mbs={mbs},recompute={'full' if ac else 'none'},dtype=bf16",
               seq=seq, batch=gbs, published_step_s=gbs * seq / tput,
               target="eager-h100-2023" if gpu == "h100" else "eager",
               published_as=f"{tput:g} tokens/s over {n} GPUs (step = {gbs} x {seq} tokens / throughput)",
               assumed="inter-node per GPU: the table's 1600 Gbps per node / 8 (A100); 3200 Gbps per node (H100)"
                       + ("; the stack as the run ran it (llm-foundry scripts/train/benchmarking/sweep.sh at "
                          "061f2c7c: IMAGE mosaicml/pytorch:2.0.1_cu118; submit_benchmarks.py: attn_impl "
                          "default 'triton', a pre-Hopper flash kernel, priced at FlashAttention-2's 35% of "
                          "H100 peak, kernels.FA2_ON_HOPPER_EFF, an upper bound for it) and its fitted "
                          "kernels.H100_2023_EFF" if gpu == "h100" else ""))


def published(row: Row) -> float:
    """The row's published step time; a TFLOP/s-per-GPU figure becomes one through the model's FLOPs
    per token (the conversion the row's ``published_as`` states)."""
    if row.published_step_s is not None:
        return row.published_step_s
    m = model_from_dict(row.model)
    tokens = row.batch * row.seq
    return m.model_flops_per_token(row.seq) * tokens / (row.extra["tflops_per_gpu"] * 1e12 * row.extra["gpus"])


ROWS: list[Row] = [
    # ---- MosaicML llm-foundry: FSDP (ZeRO-3) data parallel, eager PyTorch + flash attention --------------
    _mosaic("1b", "a100_80gb", 8, 2048, 14, 4, False, 164109, "25GB/s"),
    _mosaic("3b", "a100_80gb", 8, 2048, 10, 2, False, 86491, "25GB/s"),
    _mosaic("7b", "a100_80gb", 8, 2048, 6, 2, False, 37130, "25GB/s"),
    _mosaic("13b", "a100_80gb", 8, 4096, 10, 3, True, 16482, "25GB/s"),
    _mosaic("30b", "a100_80gb", 8, 2048, 3, 21, True, 7330, "25GB/s"),
    _mosaic("70b", "a100_80gb", 64, 2048, 8, 4, True, 26274, "25GB/s"),
    _mosaic("7b", "a100_40gb", 64, 2048, 18, 1, True, 234614, "25GB/s"),
    _mosaic("13b", "a100_40gb", 32, 2048, 14, 1, True, 63946, "25GB/s"),
    _mosaic("30b", "a100_40gb", 128, 2048, 6, 1, True, 110803, "25GB/s"),
    _mosaic("1b", "h100", 64, 2048, 20, 1, False, 2841754, "50GB/s"),
    _mosaic("3b", "h100", 8, 8192, 3, 6, False, 132626, "50GB/s"),
    _mosaic("7b", "h100", 8, 2048, 6, 1, False, 85144, "50GB/s"),
    _mosaic("13b", "h100", 64, 2048, 2, 1, False, 307209, "50GB/s"),
    _mosaic("30b", "h100", 32, 2048, 14, 3, True, 73860, "50GB/s"),
    _mosaic("70b", "h100", 64, 2048, 8, 4, True, 66523, "50GB/s"),
    # ---- Megatron-Turing NLG 530B: Megatron-DeepSpeed, TP8 x PP35 -----------------------------------------
    *[Row(name=f"MT-NLG 530B x{n}", source="mtnlg", where=f"{n // 8} DGX A100 servers: {t} s per iteration",
          model=MTNLG, nodes=[dict(DGX_A100, count=n // 8, **UNFUSED_ATTENTION)], inter_node="25GB/s",
          plan=f"tp=8,pp=35,dp={n // 280},mbs=1,recompute=full,zero=1,dtype=bf16", seq=2048, batch=1920,
          published_step_s=t, target="megatron-deepspeed-2021", published_as=f"{t} s per iteration",
          assumed="micro-batch 1 and full recomputation (not stated in section 2.4); HDR InfiniBand 200 Gb/s per GPU "
                  "(Selene)")
      for n, t in ((2240, 60.1), (2800, 50.2), (3360, 44.4))],
    # ---- BLOOM-176B: Megatron-DeepSpeed, TP4 x PP12 x DP8 -------------------------------------------------
    Row(name="BLOOM-176B x384", source="bloom", where="chronicles.md: iteration 12695, 105.22 s", model=BLOOM,
        nodes=[dict(DGX_A100, count=48, **UNFUSED_ATTENTION)], inter_node="6.25GB/s",
        plan="tp=4,pp=12,dp=8,mbs=2,recompute=full,zero=1,dtype=bf16,layers=5/6/6/6/6/6/6/6/6/6/6/5",
        seq=2048, batch=2048, published_step_s=105.22, target="megatron-deepspeed-2021",
        published_as="105.22 s per iteration",
        assumed="full recomputation (--checkpoint-activations, tr11-176B-ml.slurm); 4 x 100 Gb/s Omni-Path per "
                "node = 6.25 GB/s per GPU; stages as --pp-partition-method 'type:transformer|embedding' cuts 70 "
                "blocks and the 2 embeddings into 12 x 6 (5 blocks with each embedding); ALiBi positions (no "
                "parameters: priced as 'rope', which adds none and, fused, no traffic); the launch script's CUDA_LAUNCH_BLOCKING=1 "
                "is not priced apart (MEGATRON_DEEPSPEED_2021_EFF, fitted on MT-NLG, stands for it)"),
    # ---- Llama 3 405B on H100 (Meta's training stack): TP8 x PP16 x DP -------------------------------------
    *[Row(name=f"Llama3-405B x{n}", source="llama3", where=f"Table 4: {n:,} GPUs, TP 8, CP 1, PP 16, DP {n // 128}, "
                                                            f"{tf} TFLOPs/GPU",
          model=LLAMA3_405B, nodes=[{"count": n // 8, "devices_per_node": 8, "device": "H100-SXM",
                                     "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}],
          inter_node="50GB/s",
          plan=f"tp=8,pp=16,dp={n // 128},mbs=1,sp=1,recompute=none,zero=1,dtype=bf16,schedule=interleaved_1f1b,"
               "vpp=2,layers=" + "/".join(["3"] + ["4"] * 30 + ["3"]),
          seq=8192, batch=2048, published_step_s=None, target="megatron",
          published_as=f"{tf} TFLOPs per GPU (BF16 MFU {mfu}%), converted to a step time with autotune's model "
                       "FLOPs per token (ModelSpec.model_flops_per_token: 6 x weights + causal attention)",
          extra={"tflops_per_gpu": tf, "gpus": n},
          assumed="interleaved 1F1B with 2 chunks per stage (the paper interleaves; the chunk count is not in "
                  "Table 4), the first and last stage one layer short (the paper's balancing), micro-batch 1, "
                  "no recomputation, ZeRO-1, 400 Gb/s per GPU between nodes (the paper's RoCE fabric)")
      for n, tf, mfu in ((8192, 430, 43), (16384, 400, 41))],
    # ---- torchtitan on 64 A100 80GB: FSDP2 (ZeRO-3), eager -------------------------------------------------
    Row(name="Llama3-70B torchtitan x64", source="torchtitan", where="Llama 3 table: 70B | 1 | full | 331 | 51.7%",
        model=LLAMA3_70B, nodes=[dict(DGX_A100, count=8)], inter_node="25GB/s",
        plan="dp=64,zero=3,mbs=1,recompute=full,dtype=bf16", seq=8192, batch=64,
        published_step_s=64 * 8192 / (331 * 64), target="eager", published_as="331 tokens/s per GPU",
        assumed="sequence 8192 (torchtitan's Llama 3 default); 200 Gb/s per GPU between nodes"),
    Row(name="Llama2-13B torchtitan x64", source="torchtitan", where="Llama 2 table: 13B | 2 | no | 2162 | 61.1%",
        model=LLAMA2_13B, nodes=[dict(DGX_A100, count=8)], inter_node="25GB/s",
        plan="dp=64,zero=3,mbs=2,recompute=none,dtype=bf16", seq=4096, batch=128,
        published_step_s=128 * 4096 / (2162 * 64), target="eager", published_as="2162 tokens/s per GPU",
        assumed="200 Gb/s per GPU between nodes"),
    Row(name="Llama2-70B torchtitan x64", source="torchtitan", where="Llama 2 table: 70B | 2 | full | 353 | 50.5%",
        model=LLAMA2_70B, nodes=[dict(DGX_A100, count=8)], inter_node="25GB/s",
        plan="dp=64,zero=3,mbs=2,recompute=full,dtype=bf16", seq=4096, batch=128,
        published_step_s=128 * 4096 / (353 * 64), target="eager", published_as="353 tokens/s per GPU",
        assumed="200 Gb/s per GPU between nodes"),
]

FITTED: dict[str, list[str]] = {
    "catalogue.A100_CLOCK (the clock an A100 sustains in bf16 training, as a fraction of boost)": [
        "MPT-7b a100_80gb x8 s2048", "MPT-30b a100_80gb x8 s2048", "MPT-13b a100_40gb x32 s2048"],
    "kernels.H100_2023_EFF (MosaicML's 2023 H100 stack: share of the tensor-core rate kept)": [
        "MPT-3b h100 x8 s8192", "MPT-7b h100 x8 s2048"],
    "kernels.MEGATRON_DEEPSPEED_2021_EFF (2021-22 Megatron-DeepSpeed: share of the tensor-core rate kept)": [
        "MT-NLG 530B x2240"],
}
"""Constant -> the rows that chose it (``--fit`` re-runs the fits); every other row is held out.
Each fit's rows were named by a rule before the fit, never by their errors: the A100 clock on three
MPT A100 rows; each historical stack's ``compute_eff`` on the rows whose step time is least shaped
by anything but compute (H100 2023: the single-node rows, no inter-node network; Megatron-DeepSpeed:
MT-NLG's configuration with the most micro-batches per replica, the least pipeline bubble). The
other figures the prices rest on were chosen elsewhere: GEMM ceilings (catalogue, cuBLAS
measurements), ``datasheet.K_FILL`` (the H200 GEMM sweep), the Hopper clock (the H200 sweep),
kernel counts (counted from each runtime's code), host time per kernel (H200 sweep; Sailor's layers
for Megatron-DeepSpeed, benchmarks/bench_layers.py), eager loss traffic (counted from the ops), the
attention of 2023's pre-Hopper kernels on H100 (``kernels.FA2_ON_HOPPER_EFF``: the FlashAttention-3
paper's figure, read before these rows were priced with it, never tuned on them)."""
A100_CLOCK_GRID = [round(0.80 + 0.01 * i, 2) for i in range(14)]
EFF_GRID = [round(0.70 + 0.01 * i, 2) for i in range(31)]
EFF_FITS = {"eager-h100-2023": ("H100_2023_EFF", 1), "megatron-deepspeed-2021": ("MEGATRON_DEEPSPEED_2021_EFF", 2)}
"""Runtime -> (its ``compute_eff`` constant in ``autotune/cost/kernels.py``, its key's place in FITTED)."""


def _other_runtimes() -> dict[str, Any]:
    """Runtimes of these runs that are no autotune target: eager PyTorch (Composer, torchtitan before
    compile), MosaicML's 2023 H100 stack (``kernels.EAGER_H100_2023``: pre-Hopper attention and
    ``H100_2023_EFF``) and the 2021-22 Megatron-DeepSpeed of MT-NLG and BLOOM
    (``kernels.MEGATRON_DEEPSPEED_2021``: Sailor's Megatron-DeepSpeed kernels, host time fitted in
    benchmarks/bench_layers.py, and ``MEGATRON_DEEPSPEED_2021_EFF``)."""
    from autotune.cost.kernels import EAGER, EAGER_H100_2023, MEGATRON_DEEPSPEED_2021

    return {"eager": EAGER, "eager-h100-2023": EAGER_H100_2023, "megatron-deepspeed-2021": MEGATRON_DEEPSPEED_2021}


def predict(row: Row, runtimes: dict[str, Any] | None = None) -> dict[str, Any]:
    from autotune.targets import kernel_costs

    other = runtimes or _other_runtimes()
    cluster = cluster_from_dict({"name": row.name, "nodes": row.nodes,
                                 "inter_node": {"bandwidth": row.inter_node, "latency": "5us"}})
    est = estimate(parse_inline(row.plan), model_from_dict(row.model), cluster, row.seq, row.batch,
                   kernels=other.get(row.target) or kernel_costs(row.target))
    return {"step_time_s": est.predicted["step_time_s"], "mfu": est.predicted["mfu"],
            "feasible": est.predicted.get("feasible", True)}


def _fit_rows(index: int) -> list[Row]:
    names = list(FITTED.values())[index]
    return [r for r in ROWS if r.name in names]


def fit_compute_eff(target: str) -> float:
    """Grid the ``compute_eff`` of ``target``'s historical stack on its FITTED rows (median |error|);
    print and return the best."""
    import dataclasses

    from autotune.cost import kernels as K

    const, index = EFF_FITS[target]
    rows, base = _fit_rows(index), _other_runtimes()
    fit = {}
    for eff in EFF_GRID:
        runtimes = dict(base, **{target: dataclasses.replace(base[target], compute_eff=eff)})
        fit[eff] = statistics.median(abs(predict(r, runtimes)["step_time_s"] / published(r) - 1) for r in rows)
    best = min(fit, key=fit.get)
    print(f"fit of {target}'s compute_eff on " + ", ".join(r.name for r in rows) + " (median |error|): "
          + ", ".join(f"{k:.2f} {100 * v:.1f}%" for k, v in fit.items()) + f" -> {best:.2f} (kernels.{const}: "
          f"{getattr(K, const):.2f})")
    return best


def fit_a100_clock() -> float:
    """Grid the A100's sustained clock on the FITTED rows (median |error|); print and return the best."""
    import dataclasses

    from autotune.cost import compute
    from autotune.specs import catalogue as C

    rows = _fit_rows(0)
    keep = {n: C.CATALOGUE[n] for n in C.CATALOGUE if n.startswith("A100")}
    fit = {}
    try:
        for clk in A100_CLOCK_GRID:
            for n, d in keep.items():
                C.CATALOGUE[n] = dataclasses.replace(d, sustained_clock=clk)
            compute._RATES.clear()
            fit[clk] = statistics.median(abs(predict(r)["step_time_s"] / published(r) - 1) for r in rows)
    finally:
        C.CATALOGUE.update(keep)
        compute._RATES.clear()
    best = min(fit, key=fit.get)
    print("fit of the A100 sustained clock on " + ", ".join(r.name for r in rows) + " (median |error|): "
          + ", ".join(f"{k:.2f} {100 * v:.1f}%" for k, v in fit.items())
          + f" -> {best:.2f} (catalogue.A100_CLOCK: {keep['A100-80GB'].sustained()[0]:.3f})")
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fit", action="store_true", help="re-run the fits of FITTED's constants and print them")
    args = ap.parse_args()
    if args.fit:
        fit_a100_clock()
        for target in EFF_FITS:
            fit_compute_eff(target)
    fitted_rows = {r for rows in FITTED.values() for r in rows}
    out = []
    for row in ROWS:
        p = predict(row)
        pub = published(row)
        err = (p["step_time_s"] - pub) / pub
        out.append({"row": row.name, "source": row.source, "published_step_s": pub,
                    "predicted_step_s": p["step_time_s"], "error": err, "mfu": p["mfu"],
                    "held_out": row.name not in fitted_rows, "target": row.target, "plan": row.plan,
                    "seq_len": row.seq, "global_batch": row.batch, "model": row.model, "nodes": row.nodes,
                    "inter_node": row.inter_node, "where": row.where, "published_as": row.published_as,
                    "assumed": row.assumed})
    if args.json:
        print(json.dumps({"rows": out, "fitted": FITTED, "sources": SOURCES}, indent=1))
        return
    print(f"{'row':30s} {'source':10s} {'runtime':23s} {'published':>10s} {'predicted':>10s} {'error':>7s}  MFU")
    for o in out:
        print(f"{o['row']:30s} {o['source']:10s} {o['target']:23s} {o['published_step_s']:9.2f}s "
              f"{o['predicted_step_s']:9.2f}s {100 * o['error']:+6.1f}%  {100 * o['mfu']:.1f}%"
              + ("" if o["held_out"] else "  (fit)"))
    for label, sel in (("held out", [o for o in out if o["held_out"]]), ("fitted", [o for o in out if not o["held_out"]])):
        if not sel:
            continue
        errs = [abs(o["error"]) for o in sel]
        signs = {o["error"] > 0 for o in sel}
        print(f"{label}: {len(sel)} rows from {len({o['source'] for o in sel})} sources, median |error| "
              f"{100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%, "
              f"{'both signs' if len(signs) == 2 else 'one sign only'}")
    by: dict[str, list[float]] = {}
    for o, row in zip(out, ROWS, strict=True):
        if o["held_out"]:
            by.setdefault(f"{row.nodes[0]['device']} / {o['target']}", []).append(o["error"])
    print("held out by device / runtime: " + "; ".join(
        f"{k} {len(v)} rows median {100 * statistics.median(v):+.1f}%" for k, v in by.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
