"""The dropless dispatcher's host synchronisation, and none under a capacity factor: Megatron-Core's
alltoall dispatcher run on CPU (its ``preprocess`` on a routing map, process-group free at ep = tp = 1)
says which configurations set a sync point, and the cost model charges ``kernels.MOE_SYNC_S`` per MoE
layer forward exactly there."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from autotune.cost import kernels as K
from autotune.cost.estimate import estimate
from autotune.export import megatron as M
from autotune.plan import parse_inline
from autotune.specs.cluster import cluster_from_dict
from autotune.specs.model import load_model, model_from_dict


def _sync_point(capacity_factor: float | None) -> str:
    """Where Megatron-Core's MoEAlltoAllTokenDispatcher.preprocess leaves its host sync point for a
    routing map of 64 tokens over 8 experts, top-2, on one rank (dropless, or drop-and-pad with the
    capacity factor, as the Megatron exporter writes it: --moe-pad-expert-input-to-capacity)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D
    cfg = types.SimpleNamespace(moe_router_topk=2, moe_expert_capacity_factor=capacity_factor,
                                moe_router_padding_for_quantization=False, moe_permute_fusion=True)
    me = types.SimpleNamespace(config=cfg, drop_and_pad=capacity_factor is not None, num_experts=8,
                               num_local_experts=8, ep_size=1, tp_size=1, moe_expert_capacity_factor=capacity_factor,
                               permute_idx_device=None, cuda_sync_point="no_sync", cuda_dtoh_point="before_permutation_1",
                               cuda_sync_point_priority={"before_permutation_1": 0, "before_ep_alltoall": 1,
                                                         "before_permutation_2": 2, "before_finish": 3, "no_sync": 4})
    me._maybe_update_cuda_sync_point = types.MethodType(D._maybe_update_cuda_sync_point, me)
    routing = torch.zeros(64, 8, dtype=torch.bool)
    routing[torch.arange(64), torch.arange(64) % 8] = True
    routing[torch.arange(64), (torch.arange(64) + 1) % 8] = True
    D.preprocess(me, routing)
    return me.cuda_sync_point


def test_megatron_syncs_dropless_and_not_under_drop_and_pad():
    assert _sync_point(None) != "no_sync"
    assert _sync_point(1.0) == "no_sync"


def test_the_sync_is_charged_to_dropless_layers_only():
    cluster = cluster_from_dict({"name": "dgx-h100-16", "inter_node": {"bandwidth": "50GB/s", "latency": "5us"},
                                 "nodes": [{"count": 2, "devices_per_node": 8, "device": "H100-SXM"}]})
    d = load_model("qwen3-30b-a3b").to_dict()
    balanced = model_from_dict({**d, "moe": {**d["moe"], "router": {"force_balance": True}}})
    capped = model_from_dict({**d, "moe": {**d["moe"], "router": {"dropless": False, "capacity_factor": 1.0}}})
    plan = "dp=16,ep=8,mbs=1,zero=1,dtype=bf16"
    a, c = (estimate(parse_inline(plan), m, cluster, 4096, 64, kernels=M.KERNELS) for m in (balanced, capped))
    # both route every EP rank its even load (forced balance; capacity factor 1), so only the sync differs
    assert a.breakdown["moe"]["imbalance"] == c.breakdown["moe"]["imbalance"] == 1.0
    syncs = M.KERNELS.moe_syncs * balanced.moe_layer_count * (64 // 16)
    assert a.breakdown["moe"]["moe_host_s"] - c.breakdown["moe"]["moe_host_s"] == pytest.approx(syncs * K.MOE_SYNC_S)
    assert K.moe_layer_host(M.KERNELS, 16, None)[0] - K.moe_layer_host(M.KERNELS, 16, None, dropless=False)[0] \
        == pytest.approx(M.KERNELS.moe_syncs * K.MOE_SYNC_S)
