"""What `autotune apply` is asked to do (ApplyOptions): the options autotune/export/apply.py's work
reads, built by the command from its flags (search/options.py's SearchOptions is the model)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ApplyOptions:
    study: str | None = None
    """Study whose best trial (the best measured one once validated) is exported; or ``plan_file``."""
    plan_file: str | None = None
    """Plan JSON file to export; or ``study``."""
    trial: int | None = None
    """With ``study``: trial N instead of the best (e.g. a point of the Pareto front)."""
    fmt: str = "json"
    """Export target: a name of autotune.export.FORMATS."""
    output: str | None = None
    """File the export is written to (all or nothing); None: printed."""
    launch: bool = False
    """Run the plan with autotune's runtime under torchrun instead of exporting it."""
    dry_run: bool = False
    """With ``launch``: only the torchrun commands, nothing started."""
    steps: int = 5
    """With ``launch``: measured steps."""
    timeout_s: float = 600.0
    """With ``launch``: seconds a rank waits for a silent peer before the launch fails."""
    node_rank: int | None = None
    """With ``launch``: only node-rank K's command of a multi-node plan."""
    hosts: str | None = None
    """With ``launch``: hosts file; every node is started from here (autotune/hostfile.py)."""
    remote_shell: str | None = None
    """With ``hosts``: the remote shell that starts the other nodes."""
    model: str | None = None
    """With ``plan_file``: the model it is for (unless the file records it)."""
    seq_len: int | None = None
    """With ``plan_file``: sequence length."""
    global_batch: int | None = None
    """With ``plan_file``: global batch."""
    cluster: str | None = None
    """Cluster file, ``local`` or ``local:N``; None: what the study or plan records."""
    storage: str
    """Optuna storage URL the study is read from."""
    force: bool = False
    """Write even when the file says another format or the plan does not fit in memory."""
    dtype: str = "auto"
    """Precision; ``auto``: the plan's own, checked against the cluster's devices."""
