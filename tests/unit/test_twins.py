"""profilers/twins.py: the helpers that keep the other cores busy while tune times its layers come up,
work, and are gone afterwards; with none asked for, nothing starts."""

import time

from autotune.specs import load_model
from profilers.layers import LayerSweep
from profilers.twins import twins


def test_no_twin_for_one_rank():
    with twins(load_model("tiny"), None, 0) as up:
        assert up == 0


def test_a_twin_runs_beside_the_timing_and_stops_after_it():
    import multiprocessing as mp

    sweep = LayerSweep(micro_batches=(1,), seq_lens=(16,), tp=(1,), dtype="fp32", pieces=("block",), threads=1)
    before = set(p.pid for p in mp.active_children())
    with twins(load_model("tiny"), sweep, 1) as up:
        assert up == 1
        kids = [p for p in mp.active_children() if p.pid not in before]
        assert len(kids) == 1 and kids[0].is_alive()
        time.sleep(0.2)
    assert not kids[0].is_alive()


def test_a_twin_of_an_moe_sweep_builds_every_ep_and_etp_shard():
    """The helpers build the sweep's own points (an MoE model's moe piece at each (ep, etp)): a
    helper that cannot is not waited for, and none comes up."""
    sweep = LayerSweep(micro_batches=(1,), seq_lens=(16,), tp=(1,), dtype="fp32", pieces=("moe",), threads=1,
                       ep=(1, 2), etp=(1, 2), moe_world=2)
    t0 = time.perf_counter()
    with twins(load_model("tiny-moe"), sweep, 1) as up:
        assert up == 1, f"the twin did not come up ({time.perf_counter() - t0:.0f} s)"
