"""Memory per rank by hand: 18 bytes per parameter under bf16 (2 weights, 4 fp32 gradients, 12 fp32 Adam
states: Megatron's distributed-optimizer table; ZeRO, Rajbhandari et al. 2020, shards them) and
Korthikanti et al. 2022's activations sbh(34 + 5as/h) and its tensor/sequence-parallel and
recomputation forms, on GPT shapes (GeLU, f = 4h, kv = h) where the paper's figures apply as printed."""

import pytest
from _cost_helpers import GELU, one_node

from autotune.cost import estimate
from autotune.cost.memory import RESERVE_FRACTION, layer_activation_bytes
from autotune.plan import parse_inline
from autotune.specs.catalogue import FRAMEWORK_RESERVE

S, B = 128, 2
s, b, h, a, L, V = S, B, GELU.hidden, GELU.heads, GELU.layers, GELU.vocab
PHI = GELU.param_count()


def _act(t=1, sp=False, recompute="none"):
    return layer_activation_bytes(GELU, micro_batch=b, tokens_local=s, cp_tokens=s, seq_len=s,
                                  heads_local=a // t, tp=t, sequence_parallel=sp, recompute=recompute, act_bytes=2)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_table_2(t):
    sbh = s * b * h
    # Table 2: tensor parallel without SP, with SP, with SP and selective recomputation, full
    assert _act(t)[0] == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert _act(t, sp=True)[0] == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert _act(t, sp=True, recompute="selective")[0] == pytest.approx(sbh / t * 34)
    assert _act(t, recompute="selective")[0] == pytest.approx(sbh * (10 + 24 / t))
    assert _act(t, sp=True, recompute="full")[0] == pytest.approx(2 * sbh / t)
    assert _act(t, recompute="full")[0] == pytest.approx(2 * sbh)


def _total(alloc):
    return alloc + FRAMEWORK_RESERVE["cuda"] + RESERVE_FRACTION * alloc


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_single_device_memory_total_by_hand(recompute):
    est = estimate(parse_inline(f"dp=1,mbs={B},recompute={recompute}"), GELU, one_node(1), S, 4)
    # a GPU device: fused attention keeps the fp32 log-sum-exp (4 bytes per query and head), not 5as^2b
    layer_full = s * b * h * 34 + 4 * a * s * b
    kept = {"none": layer_full, "selective": s * b * h * 34, "full": 2 * s * b * h}[recompute]
    # pp = 1: one micro-batch in flight; recomputation rebuilds one layer at a time on top
    acts = L * kept + (layer_full - kept)
    logits = s * b * V * (2 + 4)  # bf16 logits and the fp32 copy the loss reads
    states = 18 * PHI  # 2 weights + 4 fp32 gradients + 12 fp32 Adam states per parameter
    assert est.predicted["memory_bytes"][0] == pytest.approx(_total(states + acts + logits))
    terms = est.breakdown["ranks"][0]["memory"]
    assert terms["activations"] == pytest.approx(acts)
    assert terms["weights"] + terms["gradients"] + terms["optimizer"] == pytest.approx(states)


# ZeRO-2 with one micro-batch: its 4/4 bytes of gradient shards fit in the 2 bytes of gathered weights
# its backward frees (autotune/cost/memory.py), so they add nothing
# ZeRO-3: the fp32 shard is the master the 12 bytes count; no 16-bit shard besides the gathered blocks
@pytest.mark.parametrize("zero,expected", [(0, 18.0), (1, 2 + 4 + 12 / 4), (2, 2 + 12 / 4), (3, 16 / 4)])
def test_zero_stages_shard_over_dp(zero, expected):
    est = estimate(parse_inline(f"dp=4,zero={zero}"), GELU, one_node(4), S, 4)
    t = est.breakdown["ranks"][0]["memory"]
    extra = 2 * 2 * GELU.layer_params() if zero == 3 else 0.0  # FSDP's gathered block and the prefetched one
    assert t["weights"] + t["gradients"] + t["optimizer"] == pytest.approx(expected * PHI + extra)


def test_activations_times_micro_batches_in_flight_under_1f1b_and_gpipe():
    m = 8
    for sched, inflight in (("1f1b", lambda st: min(4 - st, m)), ("gpipe", lambda st: m)):
        est = estimate(parse_inline(f"pp=4,schedule={sched}"), GELU, one_node(4), S, m)
        per = s * 1 * h * 34 + 4 * a * s  # micro-batch size 1, fused attention on a GPU
        for r, row in enumerate(est.breakdown["ranks"]):
            assert row["memory"]["activations"] == pytest.approx(per * 1 * inflight(r)), (sched, r)


def test_cpu_math_attention_keeps_the_korthikanti_scores_term():
    from _cost_helpers import device

    est = estimate(parse_inline(f"dp=1,mbs={B}"), GELU, one_node(1, dev=device(kind="cpu")), S, 4)
    acts = L * s * b * h * (34 + 5 * a * s / h)  # Korthikanti et al. Table 2, no parallelism
    assert est.breakdown["ranks"][0]["memory"]["activations"] == pytest.approx(acts)


def test_cpu_devices_have_no_fixed_reserve():
    from _cost_helpers import device

    est = estimate(parse_inline("dp=1"), GELU, one_node(1, dev=device(kind="cpu")), S, 1)
    t = est.breakdown["ranks"][0]["memory"]
    alloc = t["weights"] + t["gradients"] + t["optimizer"] + t["activations"] + t["logits"]
    assert t["reserve"] == pytest.approx(RESERVE_FRACTION * alloc)


@pytest.mark.parametrize("inline", ["dp=2", "pp=2", "tp=2,sp=1", "dp=2,zero=1,recompute=full", "cp=2,hp=2"])
def test_runtime_prelaunch_check_asks_the_cost_model(inline, monkeypatch):
    """The runtime refuses a local trial exactly when the cost model's busiest rank exceeds the
    device: one memory model for the search and the pre-launch check."""
    from autotune.cost.plan_memory import peak_rank_memory
    from autotune.errors import InputError
    from autotune.runtime import trial
    from autotune.specs import load_cluster, load_model

    plan = parse_inline(inline + ",dtype=fp32")
    model, S_, B_ = load_model("tiny"), 128, 8
    cluster = load_cluster(f"local:{plan.world}")
    need, rank, terms = peak_rank_memory(plan, model, cluster, S_, B_)
    est = estimate(plan, model, cluster, S_, B_)
    assert need == max(est.predicted["memory_bytes"])
    assert est.predicted["memory_bytes"][rank] == need
    assert need == pytest.approx(sum(terms[k] for k in ("weights", "gradients", "optimizer", "activations",
                                                         "logits", "reserve")))
    monkeypatch.setattr(trial, "_device_memory", lambda kind, world: need)
    trial.prepare(plan, model, S_, B_, device="cpu")  # exactly enough: accepted
    monkeypatch.setattr(trial, "_device_memory", lambda kind, world: need * (1 - 1e-9))
    with pytest.raises(InputError, match="needs about"):
        trial.prepare(plan, model, S_, B_, device="cpu")


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_gradients_are_whole_while_micro_batches_accumulate(zero):
    """The runtime (FSDP2) reduce-scatters once a step, in the last backward: a rank running one
    micro-batch holds gradient shards (the ZeRO paper's count), one running several holds the whole
    fp32 accumulation buffer, and so does every pipeline stage (torch's stages always accumulate)."""
    one = estimate(parse_inline(f"dp=4,zero={zero}"), GELU, one_node(4), S, 4)
    four = estimate(parse_inline(f"dp=4,zero={zero}"), GELU, one_node(4), S, 16)
    # one micro-batch: shards (under ZeRO-2 within the room its freed weights leave, module docstring)
    assert one.breakdown["ranks"][0]["memory"]["gradients"] == pytest.approx(
        max(0.0, 4 * PHI / 4 - 2 * PHI) if zero == 2 else 4 * PHI / 4)
    assert four.breakdown["ranks"][0]["memory"]["gradients"] == pytest.approx(4 * PHI)
    pipe = estimate(parse_inline(f"dp=2,pp=2,zero={zero},schedule=gpipe"), GELU, one_node(4), S, 2)
    for row in pipe.breakdown["ranks"]:  # one micro-batch per replica, still whole under pipelining
        stage_params = row["memory"]["optimizer"] / 12 * 2  # 12 bytes a parameter, sharded over dp=2
        assert row["memory"]["gradients"] == pytest.approx(4 * stage_params)


def test_zero3_weights_are_whole_when_gathered_per_step():
    """Replicas with different micro-batch counts gather once a step and keep the weights over the
    forwards (autotune/runtime/sharding.py): ZeRO-3 then holds the weights as ZeRO-2 does. fp32:
    the sharded parameter is the weight itself (no master), counted with the gathered blocks."""
    even = estimate(parse_inline("dp=4,zero=3"), GELU, one_node(4), S, 16).breakdown["ranks"][0]["memory"]
    uneven = estimate(parse_inline("dp=4,zero=3,samples=6/2/4/4"), GELU, one_node(4), S, 16)
    assert even["weights"] == pytest.approx(2 * 2 * GELU.layer_params())  # gathered blocks (masters: optimizer)
    for row in uneven.breakdown["ranks"]:
        assert row["memory"]["weights"] == pytest.approx(2 * PHI)
    fp32 = estimate(parse_inline("dp=4,zero=3,dtype=fp32"), GELU, one_node(4), S, 16).breakdown["ranks"][0]
    assert fp32["memory"]["weights"] == pytest.approx(4 * PHI / 4 + 2 * 4 * GELU.layer_params())


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_micro_batches_that_fit_reads_rank_memory_backwards(recompute):
    # rank_memory at micro-batch 1, read backwards, against the memory it prices at each micro-batch
    from autotune.cost.memory import micro_batches_that_fit

    def row(mbs):
        est = estimate(parse_inline(f"dp=1,mbs={mbs},recompute={recompute}"), GELU, one_node(1), S, 64)
        return est.breakdown["ranks"][0]

    one = row(1)
    cap = one["memory_bytes"] + 5.5 * (one["memory"]["activations"] + one["memory"]["logits"]) * (1 + RESERVE_FRACTION)
    n = micro_batches_that_fit(one["memory"], cap)
    assert n == 6  # 1 + 5.5 more, whole
    for mbs in (1, 2, 4, 8):
        assert (row(mbs)["memory_bytes"] <= cap) == (mbs <= n)


# Each framework's model states as it allocates them (memory.state_bytes, issue 39 item 10): DeepSpeed's
# ZeRO optimizer keeps an fp32 copy of the parameters AND of the gradients beside Adam (16) with 16-bit
# weights and gradients; Accelerate's autocast keeps fp32 weights and gradients; Megatron under fp16 keeps
# fp16 gradients and fp32 main gradients; under bf16 Megatron and torchtitan allocate as the runtime does.
@pytest.mark.parametrize("target,dtype,zero,expected", [
    ("runtime", "bf16", 1, 2 + 4 + 12 / 4),
    ("deepspeed", "bf16", 0, 2 + 2 + 16),
    ("deepspeed", "bf16", 1, 2 + 2 + 16 / 4),
    ("deepspeed", "fp16", 3, (2 + 2 + 16) / 4),  # its 16-bit shard, 16-bit gradient shards, fp32 copies + Adam
    ("accelerate", "bf16", 0, 4 + 4 + 8),
    ("megatron", "bf16", 1, 2 + 4 + 12 / 4),
    ("megatron", "fp16", 1, 2 + 2 + 16 / 4),
    ("torchtitan", "bf16", 3, 16 / 4),
])
def test_each_target_prices_its_own_model_states(target, dtype, zero, expected):
    from _cost_helpers import device

    from autotune.targets import kernel_costs

    node = one_node(4, device(peak_flops={"bf16": 1e12, "fp16": 1e12, "fp32": 5e11}))
    est = estimate(parse_inline(f"dp=4,zero={zero},dtype={dtype}"), GELU, node, S, 4, kernels=kernel_costs(target))
    t = est.breakdown["ranks"][0]["memory"]
    gathered = 2 * 2 * GELU.layer_params() if zero == 3 else 0.0  # the gathered block and the prefetched one
    assert t["weights"] + t["gradients"] + t["optimizer"] == pytest.approx(expected * PHI + gathered)
    runtime = estimate(parse_inline(f"dp=4,zero={zero},dtype={dtype}"), GELU, node, S, 4)
    assert t["activations"] == runtime.breakdown["ranks"][0]["memory"]["activations"]  # states alone differ
