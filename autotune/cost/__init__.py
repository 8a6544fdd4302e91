"""The cost model: step time, tokens/s, MFU and memory per rank of a plan on a (mixed) cluster.

``estimate(plan, model, cluster, seq_len, global_batch, *, calibration=None, timeline=True)``;
see estimate.py for how compute.py, comm.py, memory.py and pipeline.py fit together.
"""

from autotune.cost.estimate import Estimate, estimate

__all__ = ["Estimate", "estimate"]
