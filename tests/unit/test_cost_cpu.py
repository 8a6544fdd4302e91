"""The CPU terms of the cost model against independent computations: the ring's attention blocks
against a brute-force walk over token positions, the measured-collective table against its own
rows and log-log interpolation by hand, the per-call GEMM cost, attention from measured call times,
the sync term's call count against a hand count of the runtime's collectives, and accelerators left
exactly as they were (no CPU term leaks into a GPU figure)."""

import math

import pytest
from _cost_helpers import HUGE, device, one_node

from autotune.cost import comm as C
from autotune.cost import estimate
from autotune.cost.collectives import collectives_for
from autotune.cost.compute import CPU_GEMM_CALL_S, SHORT_CALL_EXPONENT, rates_for, ring_blocks
from autotune.cost.cpu import GlooTable
from autotune.errors import InputError
from autotune.plan import parse_inline
from autotune.specs import Link, ModelSpec

MODEL = ModelSpec(name="cpu-test", layers=2, hidden=64, heads=8, kv_heads=4, ffn_hidden=176, vocab=256,
                  activation="swiglu")


def _positions(tokens, index, zigzag, S):
    """Position segments of CP rank ``index`` written out from the layout's definition."""
    if not zigzag or len(tokens) == 1:
        a = sum(tokens[:index])
        return [list(range(a, a + tokens[index]))]
    a = sum(t // 2 for t in tokens[:index])
    h = tokens[index] // 2
    return [list(range(a, a + h)), list(range(S - a - h, S - a))]


@pytest.mark.parametrize("tokens,zigzag", [((8, 8), True), ((8, 8), False), ((4, 8, 4), True), ((4, 4, 4, 4), True),
                                           ((2, 6, 8), False), ((4, 12), True)])
def test_ring_blocks_are_the_visible_segment_pairs(tokens, zigzag):
    S = sum(tokens)
    for i in range(len(tokens)):
        want = []
        for q in _positions(tokens, i, zigzag, S):
            for j in range(len(tokens)):
                for k in _positions(tokens, j, zigzag, S):
                    visible = any(kp <= qp for qp in q for kp in k)
                    if q and k and visible:
                        want.append((len(q), len(k), max(k) > min(q)))  # causal unless every key precedes
        assert sorted(ring_blocks(tokens, i, zigzag, S)) == sorted(want)


TABLE = [{"op": "all_reduce", "group_size": 2, "bytes": b, "time_s": t}
         for b, t in ((4096, 2e-4), (65536, 3e-4), (1048576, 8e-4))] + [
    {"op": "all_to_all", "group_size": 2, "bytes": 4096, "time_s": 1e-4},
    {"op": "all_to_all", "group_size": 2, "bytes": 65536, "time_s": 1e-4 * 16 ** 0.5}]
INTRA = Link(bandwidth=1e9, latency=1e-5, kind="intra")


def test_measured_collectives_follow_the_table():
    K = GlooTable(TABLE)
    assert K.all_reduce(INTRA, 2, 65536) == pytest.approx(3e-4)  # a measured row
    assert K.all_reduce(INTRA, 2, 100) == pytest.approx(2e-4)  # latency floor below the smallest
    mid = math.sqrt(65536 * 1048576)  # half way in log bytes: half way in log time
    assert K.all_reduce(INTRA, 2, mid) == pytest.approx(math.sqrt(3e-4 * 8e-4))
    assert K.all_reduce(INTRA, 2, 4 * 1048576) == pytest.approx(4 * 8e-4)  # the largest's algbw beyond
    # the table's all-to-all bytes are each rank's input (own part included): a rank sending x to
    # its one peer has 2x in, and a two-rank exchange of x bytes each way is that all-to-all
    assert K.all_to_all(INTRA, 2, 2048) == pytest.approx(1e-4)
    assert K.p2p(INTRA, 2048) == pytest.approx(1e-4)
    assert K.p2p(INTRA, 16384) == pytest.approx(1e-4 * 8 ** 0.5 / 1)  # 32 KiB in: log-log between rows
    # group sizes, ops and links the table does not cover keep the alpha-beta formulas
    assert K.all_reduce(INTRA, 4, 65536) == C.all_reduce(INTRA, 4, 65536)
    assert K.reduce_scatter(INTRA, 2, 65536) == C.reduce_scatter(INTRA, 2, 65536)
    inter = Link(bandwidth=1e9, latency=1e-5, kind="inter")
    assert K.all_reduce(inter, 2, 65536) == C.all_reduce(inter, 2, 65536)


def test_only_a_profiled_cpu_uses_its_table():
    prof = {"links": {"collective_table": TABLE}}
    assert collectives_for(device(kind="cuda", profile=prof)) is C.FORMULAS
    assert collectives_for(device(kind="cpu")) is C.FORMULAS
    K = collectives_for(device(kind="cpu", profile=prof))
    assert K.all_reduce(INTRA, 2, 65536) == pytest.approx(3e-4)


def test_cpu_gemm_pays_a_call_cost_and_gpu_does_not():
    peak = 1e11
    prof = {"gemm": {"bf16": {"peak_flops_per_s": peak, "overhead_s": 0.0, "points": [[1e8, peak]]}}}
    cpu = rates_for(device(kind="cpu", profile=prof), "bf16", 8)
    gpu = rates_for(device(kind="cuda", profile=prof), "bf16", 8)
    assert cpu.gemm_time(1e6) == pytest.approx(CPU_GEMM_CALL_S["bf16"] + 1e6 / peak)
    assert gpu.gemm_time(1e6) == pytest.approx(1e6 / peak)
    over = rates_for(device(kind="cpu", profile={**prof, "overheads": {"gemm_call_s": 1e-3}}), "bf16", 8)
    assert over.gemm_time(1e6) == pytest.approx(1e-3 + 1e6 / peak)

    # the profiler's per-dtype form: the plan's dtype's figure; a dtype it lacks keeps the default
    per = {**prof, "overheads": {"gemm_call_s": {"bf16": 2e-3, "fp32": 5e-4}}}
    assert rates_for(device(kind="cpu", profile=per), "bf16", 8).gemm_time(1e6) == pytest.approx(2e-3 + 1e6 / peak)
    assert rates_for(device(kind="cpu", profile={**prof, "overheads": {"gemm_call_s": {"fp32": 5e-4}}}), "bf16",
                     8).gemm_call_s == CPU_GEMM_CALL_S["bf16"]
    assert rates_for(device(kind="cpu", profile={**prof, "overheads": {"gemm_call_s": {"bf16": None}}}), "bf16",
                     8).gemm_call_s == CPU_GEMM_CALL_S["bf16"]  # absent: the default
    for bad in (-1.0, float("nan"), True, "1e-3"):  # malformed: refused, not replaced by the default
        with pytest.raises(InputError):
            rates_for(device(kind="cpu", profile={**prof, "overheads": {"gemm_call_s": {"bf16": bad}}}), "bf16", 8)


def test_cpu_attention_comes_from_measured_call_times():
    # profiled with batch 1 x 4 heads: per (batch x head) call a quarter of the row's seconds
    att = {"batch": 1, "heads": 4, "by_head_dim": {
        "64": {"points": [[256, 4e-3, 8e-3], [512, 16e-3, 24e-3]]},
        "128": {"points": [[256, 6e-3, 12e-3], [512, 24e-3, 36e-3]]}}}
    r = rates_for(device(kind="cpu", profile={"attention": att}), "bf16", 64)
    assert r.attention_head_time(256, 64) == pytest.approx((1e-3, 2e-3))
    assert r.attention_head_time(256, 96) == pytest.approx((1.25e-3, 2.5e-3))  # linear in head_dim
    f, b = r.attention_head_time(362.0, 64)  # log-log in seq between 256 and 512
    w = math.log(362 / 256) / math.log(2)
    assert f == pytest.approx(1e-3 * 4 ** w) and b == pytest.approx(2e-3 * 3 ** w)
    # below the shortest sequence as seq ** SHORT_CALL_EXPONENT; below the smallest head dim that one's time
    k = (64 / 256) ** SHORT_CALL_EXPONENT
    assert r.attention_head_time(64, 64) == pytest.approx((1e-3 * k, 2e-3 * k))
    assert r.attention_head_time(256, 8) == pytest.approx((1e-3, 2e-3))
    f, b = r.attention_head_time(1024, 64)  # beyond the longest: the last segment's slope
    assert f == pytest.approx(4e-3 * 4) and b == pytest.approx(6e-3 * 3)
    assert r.attention_head_time(256, 512) == pytest.approx((1.5e-3 * 2, 3e-3 * 2))  # sqrt above the largest
    assert rates_for(device(kind="cuda", profile={"attention": att}), "bf16", 64).attention_head_time(256, 64) is None


def _cpu_cluster(sync_call, skew=0.0, n=2):
    prof = {"overheads": {"sync_call_s": sync_call, "sync_skew": skew, "op_s": 0.0, "gemm_call_s": 0.0}}
    dev = device(kind="cpu", profile=prof, mem_bw=HUGE)
    return one_node(n, dev=dev, bw=HUGE, lat=0.0)


@pytest.mark.parametrize("inline,calls_per_layer_mb", [
    ("tp=2", 4),                               # Megatron f/g: 2 all-reduces forward, 2 backward
    ("tp=2,sequence_parallel=true", 8),        # each becomes an all-gather and a reduce-scatter
    ("hp=2", 4),                               # Ulysses: qkv and output all-to-alls, both ways
    ("cp=2", 1 + 3),                           # one K/V pass forward; backward 1 K/V and 2 dK/dV passes
    ("cp=4", 3 + 7),                           # 3 K/V passes forward; backward 3 K/V and 4 dK/dV passes
    ("tp=2,recompute=full", 6),                # backward replays the forward's 2
])
def test_sync_term_counts_the_runtimes_blocking_calls(inline, calls_per_layer_mb):
    S, B = 64, 4
    n = parse_inline(inline).degrees.world
    a = estimate(parse_inline(inline), MODEL, _cpu_cluster(0.0, n=n), S, B).predicted["step_time_s"]
    b = estimate(parse_inline(inline), MODEL, _cpu_cluster(1e-3, n=n), S, B).predicted["step_time_s"]
    mb = B  # micro-batch size 1, dp 1: every sample is a micro-batch
    assert b - a == pytest.approx(1e-3 * calls_per_layer_mb * MODEL.layers * mb, rel=1e-6)


@pytest.mark.parametrize("inline,calls_per_layer_mb", [
    ("dp=2,zero=3", 2),                        # the block's gather forward and again backward
    ("dp=2,zero=3,recompute=full", 2),         # the recomputation runs on the backward's gather
])
def test_zero3_gathers_are_blocking_calls_per_micro_batch(inline, calls_per_layer_mb):
    S, B = 64, 4
    plan = parse_inline(inline)
    a = estimate(plan, MODEL, _cpu_cluster(0.0, n=2), S, B).predicted["step_time_s"]
    b = estimate(plan, MODEL, _cpu_cluster(1e-3, n=2), S, B).predicted["step_time_s"]
    mb = max(plan.shares.samples) if plan.shares.samples else B // 2  # micro-batches of one sample
    assert b - a == pytest.approx(1e-3 * calls_per_layer_mb * MODEL.layers * mb, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("inline", ["dp=2,zero=2", "dp=2,zero=3,samples=3/1", "dp=2,zero=2,pp=2"])
def test_zero_gathering_once_a_step_meets_once_a_step(inline):
    """ZeRO-2 (and ZeRO-3 with uneven replicas) gathers each block in its first forward and
    reduce-scatters it in the last backward: two blocking calls per block a step, whatever the
    micro-batch count; ZeRO-1 none."""
    S = 64
    for B in (4, 8):
        plan = parse_inline(inline.replace("3/1", f"{3 * B // 4}/{B // 4}"))
        n = plan.degrees.world
        a = estimate(plan, MODEL, _cpu_cluster(0.0, n=n), S, B).predicted["step_time_s"]
        b = estimate(plan, MODEL, _cpu_cluster(1e-3, n=n), S, B).predicted["step_time_s"]
        assert b - a == pytest.approx(1e-3 * 2 * MODEL.layers / plan.degrees.pp, rel=1e-6)
    z1 = parse_inline("dp=2,zero=1")
    assert (estimate(z1, MODEL, _cpu_cluster(1e-3, n=2), S, 4).predicted["step_time_s"]
            == estimate(z1, MODEL, _cpu_cluster(0.0, n=2), S, 4).predicted["step_time_s"])


def test_dp_has_no_per_block_sync():
    S, B = 64, 4
    a = estimate(parse_inline("dp=2"), MODEL, _cpu_cluster(0.0, 0.0), S, B).predicted["step_time_s"]
    b = estimate(parse_inline("dp=2"), MODEL, _cpu_cluster(1e-3, 0.5), S, B).predicted["step_time_s"]
    assert a == b


@pytest.mark.parametrize("inline", ["dp=2,zero=3", "dp=2,zero=2", "dp=2,zero=3,mbs=1,samples=3/1"])
def test_on_a_cpu_no_zero_gather_hides_behind_compute(inline):
    """Every ZeRO-2/3 transfer of a CPU step is exposed (gloo copies on the busy core: the gathers as
    the reduction, ``data_parallel._beyond``): exposed in the blocks plus exposed at the step equals
    all DP communication; the same plan on a GPU of the same rates hides part of its gathers."""
    S, B = 64, 4
    prof = {"overheads": {"sync_call_s": 0.0, "sync_skew": 0.0, "op_s": 0.0, "gemm_call_s": 0.0}}
    got = {}
    for kind in ("cpu", "cuda"):
        c = one_node(2, dev=device(kind=kind, profile=prof if kind == "cpu" else None, mem_bw=HUGE), bw=1e10, lat=0.0)
        r = estimate(parse_inline(inline), MODEL, c, S, B).breakdown["ranks"][0]
        got[kind] = (r["exposed_comm_s"] + r["dp_exposed_s"], r["dp_comm_s"])
    assert got["cpu"][0] == pytest.approx(got["cpu"][1], rel=1e-9) and got["cpu"][1] > 0
    assert got["cuda"][0] < got["cuda"][1]


def _corpus():
    import importlib.util
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parents[1] / "data"
    spec = importlib.util.spec_from_file_location("make_cost_corpus", data / "make_cost_corpus.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen, json.loads((data / "cost_corpus.json").read_text())["entries"]


def _reprice(gen, entries):
    from autotune.cost import compute

    compute._RATES.clear()  # CPU rates read their defaults when built: build them again
    return [gen.price(e) for e in entries]


def test_gpu_predictions_do_not_depend_on_cpu_constants_or_code(monkeypatch):
    """Every CPU constant moved far off: the corpus's GPU entries come out bit-identical while its
    CPU entries move; then every function of cpu.py raising: GPU entries still price, unchanged."""
    from autotune.cost import cpu

    gen, entries = _corpus()
    kinds = {k: gen.build_cluster(k).groups[0].device.kind for k in {e["cluster"] for e in entries}}
    gpu = [e for e in entries if kinds[e["cluster"]] != "cpu"][::4]
    cpu_entries = [e for e in entries if kinds[e["cluster"]] == "cpu"][::4]
    assert gpu and cpu_entries
    before_cpu = _reprice(gen, cpu_entries)
    monkeypatch.setattr(cpu, "CPU_GEMM_CALL_S", {k: 7e-3 for k in cpu.CPU_GEMM_CALL_S})
    for name in ("CPU_OP_S", "CPU_SYNC_CALL_S", "CPU_SYNC_SKEW"):
        monkeypatch.setattr(cpu, name, getattr(cpu, name) * 13.0 + 1e-3)
    for name in ("CPU_OPS_BLOCK_FWD", "CPU_OPS_HEAD_FWD", "CPU_OPS_RING_BLOCK_FWD"):
        monkeypatch.setattr(cpu, name, getattr(cpu, name) * 7 + 3)
    monkeypatch.setattr(cpu, "SHORT_CALL_EXPONENT", 0.3)
    try:
        after_cpu = _reprice(gen, cpu_entries)
        assert sum(a != b for a, b in zip(after_cpu, before_cpu, strict=True)) > len(cpu_entries) // 2
        assert _reprice(gen, gpu) == [{"predicted": e["predicted"], "breakdown": e["breakdown"]} for e in gpu]

        def refuse(*_a, **_k):
            raise AssertionError("a GPU estimate reached the CPU trial physics")

        for name in ("cpu_rates", "block_extras", "head_ops", "sync_waits", "head_tp_comm", "ring_blocks",
                     "measured_collectives"):
            monkeypatch.setattr(cpu, name, refuse)
        assert _reprice(gen, gpu) == [{"predicted": e["predicted"], "breakdown": e["breakdown"]} for e in gpu]
    finally:
        monkeypatch.undo()
        _reprice(gen, [])


# ---- a malformed measurement is refused in one line, not priced as if it were absent --------------
def test_malformed_cpu_measurements_are_refused_naming_the_field():
    """The context fit, the per-call constants and the gloo table each refuse what they cannot read
    (as cost/layers.py does), and read an absent one as absent."""
    from autotune.cost import cpu

    price = lambda m, s, b: (1.0, 2.0, 0.1, 0.2)  # noqa: E731
    assert cpu.context_of({"id": "p"}, "fp32", price) is None  # absent: no context factor
    bad_ref = {"id": "p", "block_ref": {"fp32": {"points": [["block", "one", 1.0, 2.0]], "shape": {}}}}
    with pytest.raises(InputError) as e:
        cpu.context_of(bad_ref, "fp32", price)
    assert e.value.field == "block_ref.fp32" and "\n" not in str(e.value)
    spec = lambda prof: type("S", (), {"profile": prof})()  # noqa: E731
    assert cpu.cpu_rates(spec({"id": "p"}), "fp32").op_s == cpu.CPU_OP_S  # absent: the default
    for over, field in (({"op_s": "fast"}, "overheads.op_s"), ({"gemm_call_s": {"fp32": -1.0}}, "overheads.gemm_call_s.fp32")):
        with pytest.raises(InputError) as e:
            cpu.cpu_rates(spec({"id": "p", "overheads": over}), "fp32")
        assert e.value.field == field
    with pytest.raises(InputError) as e:
        GlooTable([*TABLE, {"op": "all_reduce", "group_size": 2, "bytes": "big", "time_s": 1e-3}])
    assert e.value.field == f"links.collective_table[{len(TABLE)}]"
