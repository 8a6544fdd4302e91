"""Event simulation of a pipeline schedule over uneven stages.

Model chunks ``j = 0 .. p*v-1`` (in model order; which pipeline rank holds each is the schedule's
``stage_rank``: ``j % p`` for the looped schedules, a V for ZB-V) each take ``fwd[j]`` / ``bwd[j]``
seconds per micro-batch; ``wgt[j]`` of ``bwd[j]`` is the weight-gradient part (W), the rest the
input-gradient part (I), for schedules that split the backward. Moving a micro-batch's activation
between chunk j and j+1 takes ``p2p[j]`` forward and ``p2p_back[j]`` for its gradient back (the
same as ``p2p`` unless given: they differ where the two chunks' stages differ in tp, since a sender
then sends one whole tensor to each receiver it serves, ``stages.hop_copies``; 0 where both sit on one
rank). Each
rank runs its operations in the schedule's order (``autotune/schedules``, the same order the
runtime runs and the Gantt chart draws); an operation starts when the rank is free and its input
has arrived:

    F(j, i) waits for F(j-1, i) + p2p[j-1];
    B(j, i) and I(j, i) wait for the input gradient of j+1, B(j+1, i) or I(j+1, i), + p2p_back[j]
    (the last chunk: for F(j, i));     W(j, i) waits for I(j, i).

Nothing is assumed about the bubble: with equal stages and no p2p time 1F1B's idle fraction comes
out as ``(p-1)/(m+p-1)`` (tests/unit/test_cost_pipeline.py), and a slow stage sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache, reduce
from operator import add
from typing import Any

from autotune.schedules import B, F, I, Op, Schedule, W, as_schedule

FWD, BWD = F, B  # the names this module used before the split backward
EVENT_KIND = {F: "fwd", B: "bwd", I: "bwd", W: "wgrad"}
"""Timeline kind of each operation kind: the input-gradient part is backward work on the critical
path; the weight-gradient part is drawn apart (it is what zero-bubble schedules move into bubbles)."""


def op_order(schedule: Schedule | str, p: int, v: int, m: int, s: int) -> tuple[Op, ...]:
    """(kind, model chunk, micro-batch) in the order pipeline rank ``s`` runs them (``schedule``: a
    configured instance, ``autotune.schedules.schedule_of(plan)``, or a registered name)."""
    return as_schedule(schedule).op_order(p, v, m, s)


@lru_cache(maxsize=4096)
def peak_in_flight(schedule: Schedule | str, p: int, v: int, m: int, s: int, layers: tuple[int, ...]) -> tuple[int, int]:
    """(most layer-micro-batches whose activations rank ``s`` holds at once, most micro-batches of
    the last chunk in flight there), ``layers[c]`` the layers of its c-th chunk. 1F1B gives
    min(p - s, m) micro-batches (Narayanan et al. 2021), GPipe m; see ``Schedule.in_flight``."""
    return as_schedule(schedule).in_flight(p, v, m, s, layers)


@dataclass
class Simulation:
    """Finish times of every operation, per model chunk and micro-batch."""

    schedule: Schedule
    p: int
    v: int
    m: int
    program: _Program
    """The operations in the order they were timed (``_program``)."""
    ends: list[float]
    """When each operation of ``program`` ends."""
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    p2p: tuple[float, ...]
    """Hop times as simulated (0 where both chunks sit on one rank)."""
    p2p_back: tuple[float, ...]
    """Hop times of the gradients back, ``p2p_back[j]`` from chunk j+1 to j."""
    wgt: tuple[float, ...] | None
    rank_finish: list[float]
    """When each pipeline rank finishes its last operation."""
    rank_busy: list[float]
    """Seconds each pipeline rank spends in forward and backward operations."""
    makespan: float = 0.0
    """When the last pipeline rank finishes."""

    @cached_property
    def f_end(self) -> list[list[float]]:
        """End of each forward, ``[chunk][micro-batch]``."""
        return self._per_op(self.program.f_at)

    @cached_property
    def b_end(self) -> list[list[float]]:
        """End of the backward that produces the chunk's input gradient (B, or I when split)."""
        return self._per_op(self.program.b_at)

    @cached_property
    def w_end(self) -> list[list[float]] | None:
        """End of the weight-gradient backward (None when the schedule does not split it)."""
        return self._per_op(self.program.w_at) if self.program.w_at is not None else None

    def _per_op(self, at: tuple[tuple[int, ...], ...]) -> list[list[float]]:
        ends = self.ends
        return [[ends[k] for k in row] for row in at]

    def bubble_fraction(self, s: int) -> float:
        span = self.makespan
        return (span - self.rank_busy[s]) / span if span > 0 else 0.0

    def duration(self, kind: int, j: int) -> float:
        if kind == F:
            return self.fwd[j]
        if kind == B:
            return self.bwd[j]
        assert self.wgt is not None
        return self.wgt[j] if kind == W else self.bwd[j] - self.wgt[j]

    def events(self, schedule: Schedule | str | None = None, ranks: list[int] | None = None) -> list[dict]:
        """Timeline events of every pipeline rank, in the schedule's order: fwd, bwd (B or I),
        wgrad (W), comm (p2p sends) and bubble (idle gaps); ``chunk`` is the index of the operation's
        model chunk among the rank's chunks; ``rank`` the representative mesh rank of the stage when
        ``ranks`` is given."""
        sched = as_schedule(schedule) if schedule is not None else self.schedule
        out: list[dict] = []
        p, v, m = self.p, self.v, self.m
        n = p * v
        for s in range(p):
            rank = ranks[s] if ranks else s
            local = {j: c for c, j in enumerate(sched.stages_of_rank(s, p, v))}
            t = 0.0
            for kind, j, i in sched.op_order(p, v, m, s):
                if kind == F:
                    end = self.f_end[j][i]
                    send = self.p2p[j] if j < n - 1 else 0.0
                elif kind == W:
                    assert self.w_end is not None
                    end, send = self.w_end[j][i], 0.0
                else:
                    end = self.b_end[j][i]
                    send = self.p2p_back[j - 1] if j > 0 else 0.0
                start = end - self.duration(kind, j)
                if start > t + 1e-15:
                    out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t,
                                "end": start})
                out.append({"stage": s, "rank": rank, "kind": EVENT_KIND[kind], "microbatch": i,
                            "chunk": local[j], "start": start, "end": end})
                if send > 0:
                    out.append({"stage": s, "rank": rank, "kind": "comm", "comm": "pp", "microbatch": i,
                                "start": end, "end": end + send})
                t = end
            span = self.makespan
            if span > t + 1e-15:
                out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t, "end": span})
        return out


def simulate(schedule: Schedule | str, p: int, v: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
             p2p: tuple[float, ...], wgt: tuple[float, ...] | None = None,
             p2p_back: tuple[float, ...] | None = None) -> Any:
    """Run the schedule; ``fwd``/``bwd`` (and ``wgt``, the weight-gradient part of ``bwd``, needed by
    schedules that split the backward) have p*v entries, ``p2p`` (and ``p2p_back``, the gradients'
    hops where they differ) p*v - 1 (seconds)."""
    sched = as_schedule(schedule)
    if not sched.chain:
        raise NotImplementedError(f"{sched.name} prices itself from each rank's operation times and the link "
                                  "matrix (autotune/cost/helixpipe.py): its data flow is no chain of stages")
    return simulate_chain(sched, p, v, m, fwd, bwd, p2p, wgt, p2p_back)


@dataclass(frozen=True)
class _Program:
    """A chain schedule's operations for one (p, v, m), in one order that respects every
    dependency, as ``simulate_chain`` walks them: ``walk[k]`` = (1 + the index of the same rank's
    previous operation or 0, 1 + the index of the operation whose end it waits for or 0, the hop
    index: ``j`` forward out of chunk j, ``n - 1`` none, ``n + j`` the gradient back from chunk
    j + 1, ``kind * p * v + chunk``: its seconds' index in the concatenated per-kind times);
    ``last_of``: per rank 1 + the index of its last operation (0: none); ``rank_durs``: per rank
    the seconds' indices of its operations in the order it runs them. ``f_at`` / ``b_at`` /
    ``w_at``: the index in ``walk`` of each chunk's and micro-batch's F, B-or-I and W."""

    walk: tuple[tuple[int, int, int, int], ...]
    last_of: tuple[int, ...]
    rank_durs: tuple[tuple[int, ...], ...]
    f_at: tuple[tuple[int, ...], ...]
    b_at: tuple[tuple[int, ...], ...]
    w_at: tuple[tuple[int, ...], ...] | None
    rank_of: tuple[int, ...]

    @property
    def steps(self) -> tuple[tuple[tuple[int, int, int, int], ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """(walk, last_of, rank_durs): what ``simulate_chain`` walks."""
        return self.walk, self.last_of, self.rank_durs

    @cached_property
    def durs_arrays(self) -> tuple[Any, ...]:
        """``rank_durs`` as index arrays (``_busy``), or None for a rank of few operations."""
        import numpy as np

        return tuple(np.asarray(d, dtype=np.intp) if len(d) > _NUMPY_SUM else None for d in self.rank_durs)


_NUMPY_SUM = 64
"""Operations of one rank above which ``_busy`` sums its seconds with numpy (below, the call costs more)."""


def _busy(seconds: list[float], prog: _Program) -> list[float]:
    """Each rank's busy seconds, summed in the order it runs its operations, as a running total
    would: ``np.add.accumulate`` adds strictly in order (each partial sum from the one before, the
    same float additions as ``reduce(add, ...)``), in C, for a rank of many operations (a baseline
    at micro-batch 1 runs thousands); ``+ 0.0`` gives reduce's start value its say on a sum of
    negative zeros."""
    sec = None
    out = []
    for idx, arr in zip(prog.rank_durs, prog.durs_arrays, strict=True):
        if arr is None:
            out.append(reduce(add, map(seconds.__getitem__, idx), 0.0))
            continue
        if sec is None:
            import numpy as np

            sec = np.asarray(seconds, dtype=np.float64)
        out.append(float(np.add.accumulate(sec[arr])[-1]) + 0.0)
    return out


@lru_cache(maxsize=256)
def _program(sched: Schedule, p: int, v: int, m: int) -> _Program:
    """Order the operations once per (schedule, p, v, m): sweep the ranks, each running its
    operations in the schedule's order until one waits for an operation not yet placed (the same
    sweep as timing them, with nothing timed). What runs when depends on the times, but which
    operation waits for which does not, so every simulation of this shape reuses the order.

    A search builds one per pipeline shape it prices (tens, at up to a thousand micro-batches and
    eight chunks each; a baseline at micro-batch 1 of a 2,048-sample batch on 16 stages has 65,536
    operations): the placed operations are kept in flat lists indexed ``chunk * m + micro-batch``,
    each rank's order is walked as three columns (kind, chunk, micro-batch), and each operation is
    written once, as the step ``simulate_chain`` walks.

    It is longer than a screen on purpose: the sweep is the search's hottest loop (once per operation,
    up to 65,536 per shape), and each helper split out of it would be a Python call per operation."""
    n = p * v
    last = n - 1
    f_at = [-1] * (n * m)
    b_at = [-1] * (n * m)
    w_at = [-1] * (n * m) if sched.splits_backward else None
    cols = _columns(sched, p, v, m)
    walk: list[tuple[int, int, int, int]] = []
    add = walk.append
    ptr = [0] * p
    prev = [0] * p  # 1 + the index of each rank's last placed operation (0: none yet)
    durs: list[list[int]] = [[] for _ in range(p)]
    remaining = sum(len(c[1]) for c in cols)
    while remaining:
        advanced = 0
        for s, kinds, chunks, mbs in cols:
            k = k0 = ptr[s]
            size = len(kinds)
            before = prev[s]
            mine = durs[s].append
            while k < size:
                kind, j = kinds[k], chunks[k]
                at = j * m + mbs[k]
                if kind == F:
                    dep, hop = (f_at[at - m], j - 1) if j else (-2, last)
                elif kind != W:  # B or I: the input gradient of the next chunk (the last: its own F)
                    dep, hop = (b_at[at + m], n + j) if j < last else (f_at[at], last)
                else:
                    dep, hop = b_at[at], last  # type: ignore[index]
                if dep == -1:
                    break
                here = len(walk)
                if kind == F:
                    f_at[at] = here
                elif kind != W:
                    b_at[at] = here
                else:
                    w_at[at] = here  # type: ignore[index]
                d = kind * n + j
                add((before, dep + 1 if dep >= 0 else 0, hop, d))
                mine(d)
                before = here + 1
                k += 1
            advanced += k - k0
            ptr[s], prev[s] = k, before
        if not advanced:  # pragma: no cover - a schedule whose order deadlocks is a bug here
            raise RuntimeError(f"pipeline schedule {sched.name} deadlocked (p={p}, v={v}, m={m})")
        remaining -= advanced
    rank_of = tuple(sched.stage_rank(j, p, v) for j in range(n))
    ranks = range(max(rank_of) + 1)
    return _Program(tuple(walk), tuple(prev[s] for s in ranks), tuple(tuple(durs[s]) for s in ranks),
                    _rows(f_at, m), _rows(b_at, m), _rows(w_at, m) if w_at is not None else None, rank_of)


def _columns(sched: Schedule, p: int, v: int, m: int) -> list[tuple[int, list, list, list]]:
    """Each rank's operations in the schedule's order as (rank, kinds, chunks, micro-batches) columns."""
    cols = []
    for s in range(p):
        order = sched.op_order(p, v, m, s)
        kinds, chunks, mbs = (list(c) for c in zip(*order, strict=True)) if order else ([], [], [])
        cols.append((s, kinds, chunks, mbs))
    return cols


def _rows(flat: list[int], m: int) -> tuple[tuple[int, ...], ...]:
    """``flat`` (indexed ``chunk * m + micro-batch``) as one tuple per chunk."""
    return tuple(tuple(flat[c:c + m]) for c in range(0, len(flat), m))


def simulate_chain(sched: Schedule, p: int, v: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
                   p2p: tuple[float, ...], wgt: tuple[float, ...] | None = None,
                   p2p_back: tuple[float, ...] | None = None) -> Simulation:
    """The chain of model chunks run in ``sched.op_order`` (every schedule whose ``chain`` is True):
    each operation starts when its rank is free and its input has arrived (its dependency's end plus
    the hop), in the dependency order ``_program`` fixed for this shape.

    It is the estimate's inner loop (every operation of every micro-batch on every rank), kept as
    one loop over local variables; each sum is taken in the order the ranks run their operations."""
    n = p * v
    if sched.splits_backward and wgt is None:
        raise ValueError(f"schedule {sched.name} splits the backward: give wgt, the weight-gradient seconds")
    prog = _program(sched, p, v, m)
    walk, last_of, rank_durs = prog.steps
    rank_of = prog.rank_of
    hop = tuple(0.0 if rank_of[j] == rank_of[j + 1] else p2p[j] for j in range(n - 1))
    back = hop if p2p_back is None else tuple(0.0 if rank_of[j] == rank_of[j + 1] else p2p_back[j]
                                              for j in range(n - 1))
    hops = hop + (0.0,) + back  # index n - 1: no hop (adding 0.0 leaves a time as it is); n + j: back
    igr = [bwd[j] - wgt[j] for j in range(n)] if wgt is not None else bwd
    seconds = [*fwd, *bwd, *igr, *(wgt or ())]  # by kind * n + chunk: F, B, I, W
    # ends[0] = 0.0 stands for "no operation": a rank's first operation starts at 0, one with no
    # dependency waits for 0.0 + hops[n - 1] = 0.0 (every time is >= 0, so it never moves one)
    ends = [0.0]
    end = ends.append
    for before, dep, h, d in walk:
        t = ends[before]
        arrive = ends[dep] + hops[h]
        if arrive > t:
            t = arrive
        end(t + seconds[d])
    free = [ends[k] for k in last_of]
    # each rank's busy seconds summed in the order it runs its operations (as a running total would)
    busy = _busy(seconds, prog)
    return Simulation(schedule=sched, p=p, v=v, m=m, program=prog, ends=ends[1:], fwd=fwd, bwd=bwd, p2p=hop,
                      p2p_back=back, wgt=wgt, rank_finish=free, rank_busy=busy, makespan=max(free))


@lru_cache(maxsize=2048)
def simulate_cached(schedule: Schedule | str, p: int, v: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
                    p2p: tuple[float, ...], wgt: tuple[float, ...] | None = None,
                    p2p_back: tuple[float, ...] | None = None) -> Any:
    """``simulate`` memoised: DP replicas with equal shares and devices share one simulation."""
    return simulate(schedule, p, v, m, fwd, bwd, p2p, wgt, p2p_back)
