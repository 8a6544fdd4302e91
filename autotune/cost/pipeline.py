"""Event simulation of a pipeline schedule over uneven stages.

Model stages ``j = 0 .. p*v-1`` (v virtual stages per pipeline rank, chunk ``c = j // p`` on rank
``j % p``) each take ``fwd[j]`` / ``bwd[j]`` seconds per micro-batch; moving a micro-batch's
activation (or its gradient) from j to j+1 takes ``p2p[j]``. Each rank runs its operations in the
schedule's order; an operation starts when the rank is free and its input has arrived:

    F(j, i) waits for F(j-1, i) + p2p[j-1];   B(j, i) waits for B(j+1, i) + p2p[j] (last stage: F(j, i)).

The orders are those of Megatron-LM / torch.distributed.pipelining:

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019);
* ``1f1b``: ``min(p - s - 1, m)`` warm-up forwards, then one forward one backward, then the
  remaining backwards (PipeDream-Flush, Narayanan et al. 2021);
* ``interleaved_1f1b``: forwards in groups of p micro-batches per chunk, warm-up
  ``(p - s - 1) * 2 + (v - 1) * p`` (Narayanan et al. 2021, section 2.2; Megatron's
  ``forward_backward_pipelining_with_interleaving``).

Nothing is assumed about the bubble: with equal stages and no p2p time 1F1B's idle fraction comes
out as ``(p-1)/(m+p-1)`` (tests/unit/test_cost_pipeline.py), and a slow stage sets the pace.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

FWD, BWD = 0, 1


@lru_cache(maxsize=4096)
def op_order(schedule: str, p: int, v: int, m: int, s: int) -> tuple[tuple[int, int, int], ...]:
    """(kind, chunk, micro-batch) in the order pipeline rank ``s`` runs them."""
    if schedule == "interleaved_1f1b" and v > 1:
        total = m * v

        def mb(k: int) -> int:
            return (k // (p * v)) * p + k % p

        fwd = [(FWD, (k // p) % v, mb(k)) for k in range(total)]
        bwd = [(BWD, v - 1 - (k // p) % v, mb(k)) for k in range(total)]
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    else:
        fwd = [(FWD, 0, i) for i in range(m)]
        bwd = [(BWD, 0, i) for i in range(m)]
        warm = m if schedule == "gpipe" else min(p - s - 1, m)
    order = fwd[:warm]
    for k in range(len(fwd) - warm):
        order.append(fwd[warm + k])
        order.append(bwd[k])
    order += bwd[len(fwd) - warm:]
    return tuple(order)


@lru_cache(maxsize=4096)
def peak_in_flight(schedule: str, p: int, v: int, m: int, s: int, layers: tuple[int, ...]) -> tuple[int, int]:
    """(most layer-micro-batches whose activations rank ``s`` holds at once, most micro-batches of
    its last chunk in flight): forwards done minus backwards done, weighted by each chunk's layers
    (``layers[c]``), maximised over the rank's order. 1F1B gives min(p - s, m) micro-batches
    (Narayanan et al. 2021), GPipe m."""
    held = peak = 0
    last = peak_last = 0
    for kind, c, _ in op_order(schedule, p, v, m, s):
        if kind == FWD:
            held += layers[c]
            if c == v - 1:
                last += 1
                peak_last = max(peak_last, last)
            peak = max(peak, held)
        else:
            held -= layers[c]
            if c == v - 1:
                last -= 1
    return peak, peak_last


@dataclass
class Simulation:
    """Finish and start times of every operation, per model stage and micro-batch."""

    p: int
    v: int
    m: int
    f_end: list[list[float]]
    b_end: list[list[float]]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    p2p: tuple[float, ...]
    rank_finish: list[float]
    """When each pipeline rank finishes its last operation."""
    rank_busy: list[float]
    """Seconds each pipeline rank spends in forward and backward operations."""
    makespan: float = 0.0
    """When the last pipeline rank finishes."""

    def bubble_fraction(self, s: int) -> float:
        span = self.makespan
        return (span - self.rank_busy[s]) / span if span > 0 else 0.0

    def events(self, schedule: str, ranks: list[int] | None = None) -> list[dict]:
        """Timeline events of every pipeline rank: fwd, bwd, comm (p2p sends) and bubble (idle gaps),
        ``rank`` the representative mesh rank of the stage when ``ranks`` is given."""
        out: list[dict] = []
        p, v, m = self.p, self.v, self.m
        for s in range(p):
            rank = ranks[s] if ranks else s
            t = 0.0
            for kind, c, i in op_order(schedule, p, v, m, s):
                j = c * p + s
                if kind == FWD:
                    end, dur = self.f_end[j][i], self.fwd[j]
                    send = self.p2p[j] if j < p * v - 1 else 0.0
                else:
                    end, dur = self.b_end[j][i], self.bwd[j]
                    send = self.p2p[j - 1] if j > 0 else 0.0
                start = end - dur
                if start > t + 1e-15:
                    out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t,
                                "end": start})
                out.append({"stage": s, "rank": rank, "kind": "fwd" if kind == FWD else "bwd", "microbatch": i,
                            "chunk": c, "start": start, "end": end})
                if send > 0:
                    out.append({"stage": s, "rank": rank, "kind": "comm", "comm": "pp", "microbatch": i,
                                "start": end, "end": end + send})
                t = end
            span = self.makespan
            if span > t + 1e-15:
                out.append({"stage": s, "rank": rank, "kind": "bubble", "microbatch": None, "start": t, "end": span})
        return out


def simulate(schedule: str, p: int, v: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
             p2p: tuple[float, ...]) -> Simulation:
    """Run the schedule; ``fwd``/``bwd`` have p*v entries, ``p2p`` p*v - 1 (seconds)."""
    n = p * v
    f_end: list[list[float]] = [[-1.0] * m for _ in range(n)]
    b_end: list[list[float]] = [[-1.0] * m for _ in range(n)]
    orders = [op_order(schedule, p, v, m, s) for s in range(p)]
    ptr = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    remaining = sum(len(o) for o in orders)
    last = n - 1
    while remaining:
        advanced = 0
        for s in range(p):
            ops, k, t = orders[s], ptr[s], free[s]
            nops = len(ops)
            while k < nops:
                kind, c, i = ops[k]
                j = c * p + s
                if kind == FWD:
                    if j:
                        dep = f_end[j - 1][i]
                        if dep < 0:
                            break
                        dep += p2p[j - 1]
                        if dep > t:
                            t = dep
                    t += fwd[j]
                    busy[s] += fwd[j]
                    f_end[j][i] = t
                else:
                    if j < last:
                        dep = b_end[j + 1][i]
                        if dep < 0:
                            break
                        dep += p2p[j]
                    else:
                        dep = f_end[j][i]
                    if dep > t:
                        t = dep
                    t += bwd[j]
                    busy[s] += bwd[j]
                    b_end[j][i] = t
                k += 1
            advanced += k - ptr[s]
            ptr[s], free[s] = k, t
        if not advanced:  # pragma: no cover - a schedule whose order deadlocks is a bug here
            raise RuntimeError(f"pipeline schedule {schedule} deadlocked (p={p}, v={v}, m={m})")
        remaining -= advanced
    return Simulation(p=p, v=v, m=m, f_end=f_end, b_end=b_end, fwd=fwd, bwd=bwd, p2p=p2p,
                      rank_finish=free, rank_busy=busy, makespan=max(free))


@lru_cache(maxsize=2048)
def simulate_cached(schedule: str, p: int, v: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...],
                    p2p: tuple[float, ...]) -> Simulation:
    """``simulate`` memoised: DP replicas with equal shares and devices share one simulation."""
    return simulate(schedule, p, v, m, fwd, bwd, p2p)
