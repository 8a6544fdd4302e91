"""The cost model on Mixture-of-Experts models, against references: the equivalent dense model, hand
formulas of the all-to-all over its real links, a Monte Carlo of top-k routing, the active-parameter
FLOPs, and every preset priced on a cluster that fits its size."""

import math

import numpy as np
import pytest

from autotune.cost import estimate
from autotune.cost import moe_imbalance as MI
from autotune.plan import parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import PRESETS, load_model, model_from_dict
from autotune.targets import kernel_costs

INTRA = {"bandwidth": "450GB/s", "latency": "3us"}
INTER = {"bandwidth": "400Gbit/s", "latency": "10us"}


def h100(n: int):
    """DGX H100 nodes: NVLink 450 GB/s per direction inside, one 400 Gbit/s NIC per GPU across."""
    return cluster_from_dict({"name": f"dgx-h100-{n}", "inter_node": INTER, "nodes": [
        {"count": max(1, n // 8), "devices_per_node": min(8, n), "device": "H100-SXM", "intra_node": INTRA}]})


# every MoE preset on a cluster of its size, with expert parallelism > 1
PRESET_PLANS = {
    "mixtral-8x7b": (64, "dp=16,tp=2,pp=2,ep=8,sp=1,recompute=full", 4096, 512),
    "mixtral-8x22b": (128, "dp=16,tp=2,pp=4,ep=8,sp=1,vpp=2,schedule=interleaved_1f1b,recompute=full", 4096, 512),
    "qwen2-57b-a14b": (64, "dp=16,tp=2,pp=2,ep=8,sp=1,recompute=full", 4096, 512),
    "qwen3-30b-a3b": (16, "dp=8,pp=2,ep=8,mbs=2,vpp=12,schedule=interleaved_1f1b", 4096, 512),
    "qwen3-235b-a22b": (256, "dp=16,tp=2,pp=8,ep=32,etp=1,vpp=4,schedule=interleaved_1f1b", 4096, 2048),
    "deepseek-v3": (1024, "dp=64,tp=2,pp=8,ep=64,sp=1,recompute=full", 4096, 4096),
    "gpt-oss-120b": (64, "dp=32,pp=2,ep=8,recompute=full", 4096, 512),
    "gpt-oss-20b": (16, "dp=8,pp=2,ep=8", 4096, 128),
    "grok-1": (256, "dp=16,tp=4,pp=4,ep=8,sp=1,recompute=full", 4096, 1024),
    "tiny-moe": (8, "dp=4,tp=2,ep=4,sp=1", 128, 16),
    "tiny-moe-shared": (8, "dp=4,tp=2,ep=2,etp=2,sp=1", 128, 16),
}


def test_every_moe_preset_has_a_plan_here():
    assert set(PRESET_PLANS) == {n for n, m in PRESETS.items() if m.moe is not None}


@pytest.mark.parametrize("name", sorted(PRESET_PLANS))
@pytest.mark.parametrize("target", [None, "megatron"])
def test_every_preset_prices_with_moe_terms(name, target):
    n, plan, seq, batch = PRESET_PLANS[name]
    m = load_model(name)
    e = estimate(parse_inline(plan), m, h100(n), seq, batch, kernels=kernel_costs(target))
    pr, bd = e.predicted, e.breakdown
    assert 0 < pr["step_time_s"] < math.inf and len(pr["memory_bytes"]) == n
    x = bd["moe"]
    assert x["ep"] > 1 and x["experts_s"] > 0 and x["router_s"] > 0 and x["imbalance"] >= 1.0
    assert x["ep_exposed_s"] <= x["ep_comm_s"] * 1.5 + 1e-12  # full recompute runs the forward's exchange again
    # MFU counts the active parameters' FLOPs (docs/moe.md), not the total
    want = m.model_flops_per_token(seq) * seq * batch / (pr["step_time_s"] * bd["flops"]["cluster_peak_per_s"])
    assert pr["mfu"] == pytest.approx(want) and 0 < pr["mfu"] < 1
    assert bd["flops"]["model_per_step"] == pytest.approx(m.model_flops_per_token(seq) * seq * batch)
    rank0 = bd["ranks"][0]["memory"]
    assert rank0["expert_weights"] > 0 and rank0["dispatch_buffers"] > 0
    assert rank0["weights"] >= rank0["expert_weights"]


def _one_expert(dense_name: str):
    d = PRESETS[dense_name].to_dict()
    return PRESETS[dense_name], model_from_dict({**d, "moe": {"experts": 1, "top_k": 1,
                                                              "expert_ffn_hidden": d["ffn_hidden"]}})


@pytest.mark.parametrize("dense_plan,moe_plan", [
    ("dp=8", "dp=8"), ("dp=4,tp=2,sp=1", "dp=4,tp=2,etp=2,sp=1"), ("dp=2,pp=2,tp=2,sp=1", "dp=2,pp=2,tp=2,etp=2,sp=1"),
    ("dp=8,zero=1", "dp=8,zero=1"), ("dp=4,pp=2,recompute=full", "dp=4,pp=2,recompute=full")])
def test_one_expert_top_one_prices_like_the_dense_model(dense_plan, moe_plan):
    """experts=1, top_k=1 (etp = tp: the expert split as the dense FFN) is the dense model plus a
    router and the token permutation: within 2.5% slower, never faster; memory within 3% (the
    permuted copy, router probabilities, dispatch buffers)."""
    dense, moe = _one_expert("llama3-8b")
    a = estimate(parse_inline(dense_plan), dense, h100(8), 4096, 64)
    b = estimate(parse_inline(moe_plan), moe, h100(8), 4096, 64)
    ratio = b.predicted["step_time_s"] / a.predicted["step_time_s"]
    assert 1.0 < ratio < 1.025, ratio
    assert b.breakdown["moe"]["imbalance"] == 1.0
    if "etp" not in moe_plan:  # with etp = tp the expert-TP gathers take the place of the FFN's tp pair
        assert b.breakdown["moe"]["ep_comm_s"] == 0.0
    mem = max(b.predicted["memory_bytes"]) / max(a.predicted["memory_bytes"])
    assert 1.0 <= mem < 1.03, mem


def _balanced(name: str):
    m = load_model(name).to_dict()
    m["moe"] = {**m["moe"], "router": {"force_balance": True}}
    return model_from_dict(m)


@pytest.mark.parametrize("ep,nodes", [(2, 1), (4, 1), (8, 1), (16, 2)])
def test_all_to_all_volume_on_the_real_links(ep, nodes):
    """The step's all-to-all seconds against the hand formula: per MoE layer and micro-batch four
    exchanges (dispatch, combine, and both again backward), each sending tokens*top_k*hidden*2 bytes
    times (ep - 1)/ep, split evenly over the peers: those in the node over NVLink, the others over
    the NIC, the slower part pacing."""
    m = _balanced("qwen3-30b-a3b")
    world = 8 * nodes
    e = estimate(parse_inline(f"dp={world},ep={ep}"), m, h100(world), 4096, world * 2)
    x = e.breakdown["moe"]
    send = 4096 * m.moe.top_k * m.hidden * 2 * (ep - 1) / ep
    per_peer = send / (ep - 1)
    intra_n, inter_n = min(ep, 8) - 1, ep - min(ep, 8)
    one = max((intra_n) * 3e-6 + per_peer * intra_n / 450e9,
              inter_n * 10e-6 + per_peer * inter_n / 50e9 if inter_n else 0.0)
    assert x["ep_comm_s"] == pytest.approx(4 * m.layers * 2 * one, rel=1e-9)
    assert x["imbalance"] == 1.0


def test_no_exchange_without_expert_parallelism():
    e = estimate(parse_inline("dp=8"), load_model("qwen3-30b-a3b"), h100(8), 4096, 16)
    assert e.breakdown["moe"]["ep_comm_s"] == 0.0 and e.breakdown["moe"]["ep"] == 1


def test_expert_states_shard_over_ep_and_zero_over_edp():
    m = load_model("qwen3-30b-a3b")
    states = {}
    for ep in (1, 2, 4, 8):
        e = estimate(parse_inline(f"dp=8,ep={ep}"), m, h100(8), 4096, 16)
        states[ep] = e.breakdown["ranks"][0]["memory"]["expert_weights"]
    assert states[1] == pytest.approx(2 * states[2]) == pytest.approx(4 * states[4]) == pytest.approx(8 * states[8])
    assert states[1] == pytest.approx(m.moe_layer_count * m.expert_params_per_layer() * 2)
    opt = {z: estimate(parse_inline(f"dp=8,ep=2,zero={z}"), m, h100(8), 4096, 16).breakdown["ranks"][0]["memory"]
           for z in (0, 1)}
    assert opt[1]["expert_optimizer"] == pytest.approx(opt[0]["expert_optimizer"] / 4)  # edp = 8 / 2


def test_megatron_hides_the_exchange_behind_shared_experts_only():
    shared, plain = load_model("qwen2-57b-a14b"), load_model("qwen3-30b-a3b")
    for m, hides in ((shared, True), (plain, False)):
        e = estimate(parse_inline("dp=8,ep=8"), m, h100(8), 4096, 16, kernels=kernel_costs("megatron"))
        x = e.breakdown["moe"]
        assert x["overlap"] == "shared_experts"
        assert (x["ep_exposed_s"] < x["ep_comm_s"]) is hides
        t = estimate(parse_inline("dp=8,ep=8"), m, h100(8), 4096, 16, kernels=kernel_costs("torchtitan"))
        assert t.breakdown["moe"]["ep_exposed_s"] == pytest.approx(t.breakdown["moe"]["ep_comm_s"])


def test_mla_priced_as_it_computes():
    """DeepSeek-V3's attention GEMMs are its latent projections (not hidden x hidden): its block's
    matmul FLOPs per token equal 2 x its attention and active FFN parameters."""
    m = load_model("deepseek-v3")
    attn = sum(i * o for i, o, _ in m.attention_gemms())
    assert attn == m.attention_params() - m.mla.q_lora_rank - m.mla.kv_lora_rank
    e = m.moe
    ffn = 3 * m.hidden * (e.shared_width + e.top_k * e.expert_ffn_hidden) + m.router_params()
    assert m.layer_matmul_flops_fwd() == 2.0 * (attn + ffn)
    assert m.layer_attention_flops_fwd(4095) == 2.0 * m.heads * (192 + 128) * 2048


@pytest.mark.parametrize("ep,experts,top_k,tokens", [(8, 64, 8, 2048), (4, 8, 2, 4096), (32, 128, 8, 512),
                                                     (16, 256, 8, 1024)])
def test_dropless_imbalance_against_simulated_routing(ep, experts, top_k, tokens):
    """Expected busiest-rank load of uniform top-k routing, simulated, against the normal
    approximation (within 2% of the simulated expectation)."""
    rng = np.random.default_rng(0)
    share = experts // ep
    trials = 300
    loads = np.empty(trials)
    for t in range(trials):
        picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]  # k distinct experts per token
        per_rank = np.bincount((picks // share).ravel(), minlength=ep)
        loads[t] = per_rank.max() / (tokens * top_k / ep)
    moe = load_model("qwen3-30b-a3b").moe.__class__(experts=experts, top_k=top_k, expert_ffn_hidden=64)
    assert MI.imbalance(moe, ep, tokens, share) == pytest.approx(loads.mean(), rel=0.02)


def test_imbalance_rules():
    m = load_model("qwen3-30b-a3b")
    assert MI.imbalance(_balanced("qwen3-30b-a3b").moe, 8, 4096, 16) == 1.0
    d = m.to_dict()
    capped = model_from_dict({**d, "moe": {**d["moe"], "router": {"dropless": False, "capacity_factor": 1.25}}})
    assert MI.imbalance(capped.moe, 8, 4096, 16) == 1.25
    assert MI.imbalance(m.moe, 1, 4096, 128) == 1.0
    assert MI.imbalance(m.moe, 8, 1024, 16) > MI.imbalance(m.moe, 8, 8192, 16) > 1.0
    assert MI.imbalance(m.moe, 32, 4096, 4) > MI.imbalance(m.moe, 4, 4096, 32)


def test_done_when_estimate_command(tmp_path):
    """The issue's command: qwen3-235b-a22b on 256 DGX H100, its plan, --target megatron: step time,
    MFU, memory per rank and the MoE terms."""
    import json

    import yaml
    from helpers.cli import run_autotune

    c = tmp_path / "dgx-h100-256.yaml"
    c.write_text(yaml.safe_dump({"name": "dgx-h100-256", "inter_node": INTER, "nodes": [
        {"count": 32, "devices_per_node": 8, "device": "H100-SXM", "intra_node": INTRA}]}))
    args = ("estimate", "-m", "qwen3-235b-a22b", "-c", str(c), "-p",
            "dp=16,tp=2,pp=8,ep=32,etp=1,vpp=4,schedule=interleaved_1f1b", "-s", "4096", "-b", "2048",
            "--target", "megatron")
    r = run_autotune(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    for text in ("step time", "MFU", "Per rank", "MoE (128 experts, top-8; ep 32 x etp 1 x edp 1",
                 "all-to-all", "routed experts", "expert states"):
        assert text in r.stdout, text
    j = json.loads(run_autotune(*args, "--json", timeout=300).stdout)
    assert j["breakdown"]["moe"]["ep_crosses_nodes"] is True and len(j["predicted"]["memory_bytes"]) == 256


def test_pre_launch_memory_check_prices_moe_memory():
    """The runtime's pre-launch check (plan_memory.peak_rank_memory) reads the estimate's MoE memory."""
    from autotune.cost.plan_memory import peak_rank_memory

    m, c = load_model("qwen3-30b-a3b"), h100(8)
    plan = parse_inline("dp=8,ep=4")
    total, _, terms = peak_rank_memory(plan, m, c, 4096, 16)
    e = estimate(plan, m, c, 4096, 16)
    assert total == pytest.approx(max(e.predicted["memory_bytes"])) and terms["expert_weights"] > 0


def test_megatron_moe_layer_kernels_match_megatron_cores_code():
    """The routing and permutation kernels Megatron's KERNELS prices per MoE layer are what
    megatron-core's own functions issue (counted under a TorchDispatchMode on CPU)."""
    import sys
    from pathlib import Path

    from autotune.export import megatron as MG

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import count_moe_kernels as C

    assert C.router_counts() == MG.MOE_ROUTING
    assert C.permutation_counts() == MG.MOE_PERMUTATION
    k = MG.KERNELS
    assert (k.moe_fwd, k.moe_bwd) == tuple(a + b + c for a, b, c in zip(MG.MOE_ROUTING, MG.MOE_PERMUTATION,
                                                                         MG.MOE_DISPATCHER, strict=True))


def test_moe_layer_host_time_against_hand_count():
    """On one node with no pipeline the step grows, over the same runtime without MoE-layer kernels,
    by micro-batches x MoE layers x (the layer's kernels at host_s + one synchronisation): the fixed
    kernels, then per local expert its GEMMs (and quantisations under FP8: current scaling casts each
    expert's 2 GEMM inputs in 3 kernels each, amax, scale and cast), forward and backward."""
    import dataclasses

    from autotune.cost import kernels as K

    meg = kernel_costs("megatron")
    bare = dataclasses.replace(meg, moe_fwd=0, moe_bwd=0, expert_fwd=0, expert_bwd=0, expert_fp8=0, moe_syncs=0)
    m = load_model("qwen3-30b-a3b")
    for dtype, quant in (("bf16", 0), ("fp8-current", 2 * 3)):
        plan = parse_inline(f"dp=8,ep=8,mbs=1,dtype={dtype}")
        with_k = estimate(plan, m, h100(8), 4096, 64, kernels=meg)
        without = estimate(plan, m, h100(8), 4096, 64, kernels=bare)
        local = m.moe.experts // 8
        per_layer = ((meg.moe_fwd + meg.moe_bwd + local * (meg.expert_fwd + meg.expert_bwd + 2 * quant)) * meg.host_s
                     + K.MOE_SYNC_S)
        want = 64 / 8 * m.moe_layer_count * per_layer
        got = with_k.predicted["step_time_s"] - without.predicted["step_time_s"]
        assert got == pytest.approx(want, rel=0.02), (dtype, got, want)
        assert with_k.breakdown["moe"]["moe_host_s"] == pytest.approx(want, rel=1e-9)
        assert without.breakdown["moe"]["moe_host_s"] == 0.0
