"""What `autotune profile` is asked to measure: ProfileOptions (this machine's devices and links,
profilers/run.py ``run_profile``) and LayerProfileOptions (a model's pieces, ``run_layers``), built
by autotune/commands/profile.py from its flags (search/options.py's SearchOptions is the model)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    storage: str
    """Where the profile is stored (profilers/store.py)."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    nproc: int | None = None
    """Local ranks; None: one per GPU, or one per CPU core."""
    quick: bool = False
    """Fewer sizes and repeats."""
    label: str | None = None
    """Name stored with the profile."""
    emulate: dict[int, float] = field(default_factory=dict)
    """Rank -> slowdown factor to emulate (one host only)."""
    timeout_s: float = 60.0
    """Seconds a rank may stay silent before it counts as hung."""
    nnodes: int = 1
    """Hosts the profile spans (torchrun's c10d rendezvous joins them)."""
    node_rank: int | None = None
    """With ``nnodes``: this host's node-rank; None: the join order decides."""
    hosts: str | None = None
    """Hosts file: every node is started from here, this host node-rank 0 (autotune/hostfile.py)."""
    remote_shell: str | None = None
    """With ``hosts``: the remote shell that starts the other nodes."""


@dataclass(frozen=True, kw_only=True)
class LayerProfileOptions:
    model: str
    """Model whose pieces are timed (a preset name or a model file)."""
    storage: str
    """Where the layer profile is stored."""
    device: str = "auto"
    """auto (CUDA when available), cpu or cuda."""
    mbs: str | None = None
    """Micro-batch sizes, e.g. ``1,2,4``; None: the default sweep's."""
    seq: str | None = None
    """Sequence lengths, e.g. ``128,256``; None: the default sweep's."""
    tp: str | None = None
    """tp shards (a shard's weights on one device); None: unsharded."""
    dtype: str = "auto"
    """auto (the dtype trials compute in here), fp32, bf16 or fp16."""
    attention: str = "runtime"
    """runtime (what SDPA picks), fused or materialized."""
    label: str | None = None
    """Name stored with the profile."""
