"""Pricing a per-stage plan (``autotune/stages.py``): each stage at its own degrees.

A per-stage plan is priced by the same dimension modules as a uniform one; only the contexts differ
(``docs/architecture.md``, "Per-stage degrees"):

- every tp group of every replica of every stage (a "cell": stage, replica, cp index, hp index) gets
  a ``RankContext`` whose ``step`` is the plan's ``StepContext`` with the cell's own ``tp`` (so
  compute, TP collectives, memory and the optimizer step are priced at that tp, on that cell's device
  and links); cells of one tp and device that see the same links share one context, hence one rank
  cost;
- context and head parallelism inside the stages (every replica at the plan's cp and hp,
  ``stages.split_problem``) are the uniform plan's terms: the same ``StepContext`` fields (the CP
  shards' causal work and ring blocks, the Ulysses exchange of the busiest hp rank) and the same
  ``RankContext`` fields per cell (its shard's tokens, its heads, its cp and hp links among its
  replica's cells), read by ``context_parallel``, ``ulysses``, ``compute`` and ``memory`` unchanged;
- the hop between stages (``pipeline_parallel.hop_bytes``) as ``runtime/stages.py`` sends it: each
  receiving tp rank takes the whole activation (backward: its gradient) from one sending tp rank, so
  the busiest sender of a stage at tp a sends it ceil(b / a) times to a stage at tp b
  (``stages.hop_copies``; ``Links.hop_tps`` gives each chunk's next and previous stage's tp);
- the gradient reduction over replicas whose shards differ (``data_parallel.step_transfers``): the
  reduction goes piece by piece (``stages.pieces``) over the stage's dp x cp x hp cells, so every rank
  waits for the rank holding the most pieces, the replica of the smallest tp: it moves parameters / tp_min;
- the pipeline simulation (``pipeline_parallel.simulate_replicas``) runs per replica over each stage's
  own chunk times, so stages of different speed are what it already takes.

A uniform plan written as stages (``stages.as_stages``) prices exactly as the uniform plan does
(tests/unit/test_stages_cost.py), which is the reference the per-stage terms are checked against.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from autotune import dims
from autotune import stages as ST
from autotune.cost import comm as C
from autotune.cost import data_parallel as DP
from autotune.cost import recompute_modules as RMOD
from autotune.cost import ulysses as U
from autotune.cost.collectives import collectives_for
from autotune.cost.compute import DTYPE_BYTES
from autotune.schedules import schedule_of


def staged_step_context(rp: Any, model: Any, cluster: Any, seq_len: int, global_batch: int,
                        calibration: Any, kernels: Any = None) -> Any:
    """The ``StepContext`` of a resolved per-stage plan: what every cell shares (``tp`` is the
    envelope's; each cell's context carries its own, ``staged_tp_groups``). The sequence's CP shards
    and their causal work are the uniform plan's (``context.step_context``'s rule, the same functions):
    every replica splits the sequence alike (``stages.split_problem``)."""
    from autotune.cost.context import StepContext, _hop_peers, shard_keysums, shard_rings

    d, lay = rp.degrees, ST.layout_of(rp.stages)
    topo = C.topology(cluster)
    devs = tuple(topo.index[(e.node, e.device)] for e in rp.placement)
    sched = schedule_of(rp)
    chunks = tuple(sched.stages_of_rank(i, d.pp, rp.virtual_stages) for i in range(d.pp))
    hop_peers = _hop_peers(sched, d.pp, rp.virtual_stages, chunks)
    # each stage's parameter-sharing group (dp x cp x hp, dims.SHARED_BY): its cells' first ranks in rank order
    sharing = [[devs[r0] for (st, *_), r0 in lay.cell_first.items() if st == s] for s in range(d.pp)]
    dp_links = tuple(topo.ring_link(x) for x in sharing)
    tokens, zig = rp.shares.tokens, rp.cp_layout == "zigzag" and d.cp > 1
    return StepContext(
        plan=rp, model=model, cluster=cluster, topo=topo, seq_len=seq_len, global_batch=global_batch,
        calibration=calibration or {}, dtype=rp.dtype, bpe=DTYPE_BYTES[rp.dtype],
        degrees=d, v=rp.virtual_stages, n_chunks=d.pp * rp.virtual_stages,
        mbs=rp.micro_batch_size, zigzag=zig, sp=False,
        recompute=RMOD.block_recompute(rp.recompute, rp.recompute_modules), recompute_modules=rp.recompute_modules,
        zero=rp.zero_stage,
        shard_n=dims.shard_size(d),
        devs=devs, microbatches=tuple(x // rp.micro_batch_size for x in rp.shares.samples),
        kv_ratio=model.kv_heads / model.heads, a2a_heads=U.busiest_heads(d.hp, cell_heads(model, d.tp, d.hp),
                                                                        model.heads // d.tp),
        cp_max_tokens=max(tokens), keysums=shard_keysums(tokens, zig, seq_len), ring=shard_rings(tokens, zig, seq_len),
        stage_params=DP.stage_params(model, rp, chunks), dp_links=dp_links, schedule=sched, chunks=chunks,
        hop_peers=hop_peers, group_links=(), kernels=kernels, grad_reduce=rp.grad_reduce,
        moments=rp.moments)


def cell_heads(model: Any, tp: int, hp: int) -> tuple[int, ...]:
    """Query heads of each hp rank of a cell at ``tp``: the heads of one tp rank split evenly (the
    uniform plan's default ``shares.heads``; a per-stage plan has no heads share, its cells' tp differ)."""
    from autotune.plan_parts import even_split

    return tuple(even_split(model.heads // tp, hp))


def staged_tp_groups(s: Any) -> list[tuple[int, int, Any]]:
    """(first rank, replica, context) of every cell (a tp group: stage, replica, cp and hp index) in
    rank order; cells that see the same step (stage, cp and hp index, tp, device type, links,
    micro-batches) share one context."""
    rp, topo = s.plan, s.topo
    lay = ST.layout_of(rp.stages)
    steps: dict[int, Any] = {}
    contexts: dict[tuple, Any] = {}
    out = []
    for (st, r, c, h), r0 in lay.cell_first.items():
        t = rp.stages[st].replicas[r].tp
        step = steps.get(t)
        if step is None:
            heads = cell_heads(s.model, t, s.hp)
            step = steps[t] = dataclasses.replace(s, degrees=dataclasses.replace(s.degrees, tp=t),
                                                  a2a_heads=U.busiest_heads(s.hp, heads, s.model.heads // t))
        spec = topo.cluster.devices[s.devs[r0]].spec
        links = _cell_links(s, lay, (st, r, c, h), r0, t)
        m_d = s.microbatches[r]
        key = (st, c, h, t, id(spec), links, m_d)
        ctx = contexts.get(key)
        if ctx is None:
            ctx = contexts[key] = _cell_context(s, step, (st, r, c, h), spec, links)
        out.append((r0, r, ctx))
    return out


def _cell_links(s: Any, lay: Any, cell: tuple[int, int, int, int], r0: int, t: int) -> Any:
    """The ``Links`` a cell (stage, replica, cp index, hp index; first rank ``r0``, tp ``t``) sees: its
    tp group inside a node, its cp and hp groups over the replica's other cells (the slowest link, as
    the uniform mesh's, ``cost/mesh_links.py``), its hops to the same (replica, cp, hp) cell of other stages."""
    from autotune.cost.context import Links

    rp, topo, node_of = s.plan, s.topo, s.topo.node_of
    st, r, c, h = cell
    d0 = s.devs[r0]
    tp_link = topo.node_link(node_of[d0], node_of[d0]) if t > 1 else C._SELF
    split = {"cp": C._SELF, "hp": C._SELF}
    if s.cp > 1:
        split["cp"] = topo.group_link([s.devs[lay.cell_first[(st, r, k, h)]] for k in range(s.cp)])
    if s.hp > 1:
        split["hp"] = topo.group_link([s.devs[lay.cell_first[(st, r, c, k)]] for k in range(s.hp)])
    hops, hop_tps = [], []
    pp_link = C._SELF
    if s.pp > 1:
        nxt = lay.cell_first[((st + 1) % s.pp, r, c, h)]
        pp_link = topo.node_link(node_of[d0], node_of[s.devs[nxt]])
        for j, (q, f, b) in zip(s.chunks[st], s.hop_peers[st], strict=True):
            q0 = s.devs[lay.cell_first[(q, r, c, h)]]
            hops.append((topo.node_link(node_of[d0], node_of[q0]), f, b))
            hop_tps.append((_chunk_tp(s, j + 1, r, t), _chunk_tp(s, j - 1, r, t)))
    else:
        hops = [(C._SELF, False, False)] * s.v
    tps = rp.stages[st].tps
    return Links(tp=tp_link, pp=pp_link, dp=s.dp_links[st], **split, pp_hops=tuple(hops),
                 hop_tps=tuple(hop_tps) if any(q != (t, t) for q in hop_tps) else (),
                 dp_tp=min(tps) if len(set(tps)) > 1 else 0)


def _chunk_tp(s: Any, j: int, r: int, own: int) -> int:
    """The tp of replica ``r`` in the stage holding model chunk ``j`` (``own`` past either end)."""
    if not 0 <= j < s.n_chunks:
        return own
    return s.plan.stages[s.schedule.stage_rank(j, s.pp, s.v)].replicas[r].tp


def _cell_context(s: Any, step: Any, cell: tuple[int, int, int, int], spec: Any, links: Any) -> Any:
    """The ``RankContext`` of a cell (stage, replica, cp index, hp index) at ``step``'s tp on ``spec``:
    its CP shard's tokens and causal work, its hp rank's heads and tokens (``context._rank_context``'s
    rule for a cell of the uniform mesh)."""
    from autotune.cost.compute import cached_rates
    from autotune.cost.context import _new_rank_context
    from autotune.cost.windows import window_work

    rp, t = s.plan, step.tp
    st, r, c, h = cell
    cal = s.calibration.get(spec.name) or {}
    params, layer_params, rest = s.stage_params[st]
    tokens = rp.shares.tokens[c]
    tok = s.mbs * tokens / s.hp
    return _new_rank_context(
        step=step, coords=MappingProxyType(dims.origin(pp=st, dp=r, cp=c, hp=h)), spec=spec,
        rates=cached_rates(spec, s.dtype, s.model.head_dim, s.kernels), collectives=collectives_for(spec),
        cf=float(cal.get("compute", 1.0)), mf=float(cal.get("comm", 1.0)), links=links, tokens=tokens,
        heads=cell_heads(s.model, t, s.hp)[h], microbatches=s.microbatches[r],
        layers=tuple(rp.shares.layers[j] for j in s.chunks[st]),
        params=params, layer_params=layer_params, rest_params=rest, keysum=s.keysums[c], ring=s.ring[c],
        window=window_work(s, c, s.chunks[st]), tokens_local=tok, hidden_bytes=s.bpe * tok * s.model.hidden)
