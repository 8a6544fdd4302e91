"""torchtitan's per-op selective checkpointing (``autotune/cost/op_sac.py``) and its compiled loss
(``memory.logit_bytes``), priced against PyTorch running them on CPU.

The reference is torch's own selective-checkpoint machinery (``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``) under torchtitan's policy (torchtitan/distributed/
activation_checkpoint.py ``SelectiveAC._wrap_block`` at commit 363709fd, its decision rule copied
below), over a block shaped as torchtitan's (fused ``wqkv``, SDPA, ``wo``, FeedForward
``w2(silu(w1(x)) * w3(x))``): what the checkpoint stores is summed from its storage, what it runs
again from the backward's GEMM FLOPs (a backward without recomputation runs two GEMMs per forward
GEMM). On CPU the attention runs as ``_scaled_dot_product_flash_attention_for_cpu``, put on the
save list in place of the CUDA kernels torchtitan lists (same outputs: the output and an fp32
log-sum-exp per query and head)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.partitioners import get_default_op_list
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autotune.cost import op_sac as OS
from autotune.cost.estimate import estimate
from autotune.plan import parse_inline
from autotune.specs.model import model_from_dict

H, HEADS, KV_HEADS, HD, FFN, SEQ, BATCH = 64, 4, 2, 16, 96, 32, 2


def _model(bias: bool, activation: str = "swiglu"):
    return model_from_dict({"name": "sac-block", "layers": 2, "hidden": H, "heads": HEADS, "kv_heads": KV_HEADS,
                            "head_dim": HD, "ffn_hidden": FFN, "vocab": 128, "bias": bias,
                            "activation": activation})


def _save_ops() -> set:
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    return ops | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops.aten.topk.default}


def _policy():
    """torchtitan's ``wrapped_policy`` (no router gate in this block to force): save the save list's
    outputs except every second ``mm``."""
    save, mm_ops = _save_ops(), (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func in mm_ops:
            meta[key] += 1
        if func in save:
            if func in mm_ops and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


class _Block(torch.nn.Module):
    def __init__(self, bias: bool, gated: bool):
        super().__init__()
        q, kv = HEADS * HD, KV_HEADS * HD
        self.wqkv = torch.nn.Linear(H, q + 2 * kv, bias=bias)
        self.wo = torch.nn.Linear(q, H, bias=bias)
        self.w1 = torch.nn.Linear(H, FFN, bias=bias)
        self.w3 = torch.nn.Linear(H, FFN, bias=bias) if gated else None
        self.w2 = torch.nn.Linear(FFN, H, bias=bias)
        self.gated = gated

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.wqkv(F.rms_norm(x, (H,))).split([HEADS * HD, KV_HEADS * HD, KV_HEADS * HD], dim=-1)
        q = q.view(b, s, HEADS, HD).transpose(1, 2)
        k = k.view(b, s, KV_HEADS, HD).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.view(b, s, KV_HEADS, HD).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, HEADS * HD)
        h = x + self.wo(o)
        n = F.rms_norm(h, (H,))
        act = F.silu(self.w1(n)) * self.w3(n) if self.gated else F.gelu(self.w1(n))
        return h + self.w2(act)


class _MMFlops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = (args[1], args[2]) if func == torch.ops.aten.addmm.default else (args[0], args[1])
            self.flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
        return out


def _bytes(storage) -> float:
    """Bytes of the tensors the checkpoint stored (each wrapped with its version counter)."""
    seen, n = set(), 0.0
    leaves = torch.utils._pytree.tree_leaves([list(per_op.values()) for per_op in storage.values()])
    for t in (getattr(w, "val", w) for w in leaves):
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            n += t.untyped_storage().nbytes()
    return n


def _run(bias: bool, gated: bool) -> tuple[float, float]:
    """(bytes the checkpoint keeps, forward GEMM FLOPs it runs again) over one micro-batch."""
    torch.manual_seed(0)
    block = _Block(bias, gated).to(torch.bfloat16)
    x = torch.randn(BATCH, SEQ, H, dtype=torch.bfloat16, requires_grad=True)
    held = {}

    def contexts():
        fwd, rec = create_selective_checkpoint_contexts(_policy())
        held["storage"] = fwd.storage
        return fwd, rec
    with _MMFlops() as f:
        y = checkpoint(block, x, use_reentrant=False, context_fn=contexts, early_stop=False)  # as torchtitan wraps
    kept = _bytes(held["storage"]) + x.numel() * x.element_size()  # the checkpoint reruns from x
    with _MMFlops() as b:
        y.float().sum().backward()
    return kept, b.flops - 2.0 * f.flops


class _FlopRates:
    """Rates whose GEMM seconds are its FLOPs (``op_sac.rerun_seconds`` then sums FLOPs)."""
    size = None

    @staticmethod
    def gemm_time(flops: float) -> float:
        return flops


@pytest.mark.parametrize("bias,gated", [(False, True), (True, True), (False, False)])
def test_kept_bytes_and_rerun_gemms_are_torch_running_torchtitans_policy(bias, gated):
    kept, rerun = _run(bias, gated)
    m = _model(bias, "swiglu" if gated else "gelu")
    tokens = BATCH * SEQ
    priced = OS.kept_bytes(m, FFN, tokens=tokens, cp_tokens=tokens, heads_local=HEADS, tp=1, bpe=2)
    assert priced == pytest.approx(kept, rel=1e-9), (priced, kept)
    assert OS.rerun_seconds(m, _FlopRates, FFN, tokens=tokens, tp=1) == pytest.approx(rerun, rel=1e-6)
    assert (rerun == 0.0) == bias  # a biased linear is an addmm: always kept, never rerun


def test_compiled_loss_keeps_the_bf16_logits_alone():
    """``memory.logit_bytes``: eager cross-entropy over ``logits.float()`` keeps fp32 copies; compiled
    (torchtitan's ``[compile] components = ["model", "loss"]``) it keeps the bf16 logits alone."""
    from autotune.cost.memory import logit_bytes
    from autotune.targets import kernel_costs

    t, v = 64, 512

    def loss_fn(pred, labels):
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")

    def saved_per_logit(fn) -> float:
        w = torch.randn(v, H, dtype=torch.bfloat16, requires_grad=True)
        logits = torch.randn(1, t, H, dtype=torch.bfloat16) @ w.t()
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel() * x.element_size()) or x,
                                                      lambda x: x):
            fn(logits, torch.randint(0, v, (1, t)))
        return sum(s for s in sizes if s >= t * v) / (t * v)

    titan = SimpleNamespace(bpe=2, kernels=kernel_costs("torchtitan"))
    assert logit_bytes(titan) == saved_per_logit(torch.compile(loss_fn, dynamic=False))
    megatron = SimpleNamespace(bpe=2, kernels=kernel_costs("megatron"))
    assert saved_per_logit(loss_fn) >= logit_bytes(megatron) > logit_bytes(titan)


def test_torchtitan_selective_prices_its_own_policy_not_megatrons():
    """Through ``estimate``: torchtitan's ``selective`` keeps what ``op_sac`` counts per layer (less
    than Megatron's selective set here: the odd GEMM outputs and the attention's output, no norm,
    activation or even-GEMM output) and reruns GEMMs instead of the attention core; other targets
    keep pricing Megatron's count."""
    from autotune.specs.cluster import cluster_from_dict
    from autotune.targets import kernel_costs

    model = model_from_dict({"name": "d", "layers": 8, "hidden": 2048, "heads": 16, "kv_heads": 4,
                             "head_dim": 128, "ffn_hidden": 8192, "vocab": 32000})
    cluster = cluster_from_dict({"name": "c", "nodes": [{"count": 1, "devices_per_node": 8, "device": "H100-SXM"}],
                                 "inter_node": {"bandwidth": "50GB/s", "latency": "5us"}})
    plan = parse_inline("dp=8,zero=3,recompute=selective,mbs=2")
    per = {t: estimate(plan, model, cluster, 4096, 64, kernels=kernel_costs(t)).breakdown["ranks"][0]["memory"]
           for t in ("torchtitan", "megatron")}
    tokens = 2 * 4096
    want = OS.kept_bytes(model, 8192, tokens=tokens, cp_tokens=tokens, heads_local=16, tp=1, bpe=2)
    assert per["torchtitan"]["activation_per_layer_microbatch"] == pytest.approx(want)
    assert per["megatron"]["activation_per_layer_microbatch"] > want
    assert math.isclose(per["torchtitan"]["logits"] * 3, per["megatron"]["logits"])  # 2 bytes a logit, not 6
