"""The activations the MoE all-to-all overlap keeps in flight (``memory.paired_layer``), against a
layer-level replay of Megatron-Core's combined 1F1B schedule (pipeline_parallel/combined_1f1b.py
``combined_1f1b_schedule_for_no_pipelining`` and model_chunk_schedule_plan.py
``MultiTransformerLayerSchedulePlan.run``): the first micro-batch's forward alone; then micro-batch
i+1's forward layer j beside micro-batch i's backward layer L-1-j, the backward's layer released after
its pair except its first layer (``is_last_layer_in_bwd``), released at the end of the step; the last
backward alone."""

import pytest

from autotune.cost import estimate
from autotune.plan import parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model

CLUSTER = {"name": "h100-1n", "inter_node": {"bandwidth": "400Gbit/s", "latency": "10us"},
           "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM",
                      "intra_node": {"bandwidth": "450GB/s", "latency": "3us"}}]}


def combined_peak(layers: int, microbatches: int) -> int:
    """Most layer-micro-batches held at once by Megatron-Core's combined schedule without pipelining."""
    held: dict[int, int] = {0: layers}  # micro-batch -> layers stored; the first forward runs alone
    peak = layers
    for i in range(microbatches - 1):
        held[i + 1] = 0
        for j in range(layers):  # forward layer j of i+1 beside backward layer L-1-j of i
            held[i + 1] += 1
            peak = max(peak, sum(held.values()))
            if j < layers - 1:
                held[i] -= 1
        held.pop(i)  # the first layer's state released at the end of the step
    return peak  # the last backward alone only frees


def plain_peak(layers: int, microbatches: int) -> int:
    """The same without the overlap (forward, then backward, one micro-batch at a time)."""
    return layers


@pytest.mark.parametrize("mbs_count", [1, 2, 4])
def test_in_flight_without_pipelining_matches_megatron_cores_combined_schedule(mbs_count):
    m, c = load_model("tiny-moe"), cluster_from_dict(CLUSTER)
    batch = 8 * mbs_count  # dp 8, micro-batch 1
    got = {}
    for overlap in (0, 1):
        plan = parse_inline(f"dp=8,ep=8,mbs=1,recompute=selective,moe_a2a_overlap={overlap}").resolve(m, c, 256, batch)
        got[overlap] = estimate(plan, m, c, 256, batch).breakdown["ranks"][0]["memory"]
    assert got[0]["layers_microbatches_in_flight"] == plain_peak(m.layers, mbs_count)
    assert got[1]["layers_microbatches_in_flight"] == combined_peak(m.layers, mbs_count)
    extra = combined_peak(m.layers, mbs_count) - plain_peak(m.layers, mbs_count)
    assert got[1]["activations"] - got[0]["activations"] == pytest.approx(
        extra * got[0]["activation_per_layer_microbatch"])


def test_with_pipelining_the_pairs_add_one_layer_beyond_the_warm_up():
    """Interleaved 1F1B: Megatron-Core runs one more warm-up forward with the overlap
    (``get_pp_rank_microbatches``) and frees each backward layer as above, so the rank holds the plain
    schedule's peak (warm-up + 1 chunk-micro-batches) plus the pair's one layer."""
    m, c = load_model("tiny-moe"), cluster_from_dict(CLUSTER)
    got = {}
    for overlap in (0, 1):
        plan = parse_inline(f"dp=4,pp=2,ep=4,mbs=1,vpp=2,schedule=interleaved_1f1b,recompute=selective,"
                            f"moe_a2a_overlap={overlap}").resolve(m, c, 256, 64)
        got[overlap] = estimate(plan, m, c, 256, 64).breakdown["ranks"][0]["memory"]
    assert got[1]["layers_microbatches_in_flight"] == got[0]["layers_microbatches_in_flight"] + 1
