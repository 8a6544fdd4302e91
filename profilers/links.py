"""Link micro-benchmarks between the ranks of a process group (gloo on CPU, NCCL on CUDA).

- **p2p matrix**: for every pair (i, j), i < j, a ping-pong of ``S`` bytes (i sends, j returns it);
  one-way time = round trip / 2, measured on rank i over several message sizes. Latency is the
  one-way time of the smallest message, bandwidth ``S / one_way`` of the largest; both matrices
  are symmetric (ping-pong measures both directions together). Pairs run one at a time while the
  other ranks wait at a barrier, so no two pairs share the wire.
- **Collectives**: all_reduce, all_gather, reduce_scatter, all_to_all on the groups of the first
  ``g`` ranks (g = 2, 4, 8, ... and the world), over message sizes. Sizes and bandwidths follow
  nccl-tests (doc/PERFORMANCE.md): ``S`` is the full buffer (all_gather's output,
  reduce_scatter's input), ``algbw = S / t`` and ``busbw = algbw * factor`` with factor
  ``2(n-1)/n`` for all_reduce and ``(n-1)/n`` for all_gather, reduce_scatter and all_to_all. The
  time of a collective is the slowest member's median.
- **alpha-beta**: ``t = alpha + S / beta`` (Hockney) fitted per link class (``intra`` = same
  host, ``inter`` = different hosts) from the p2p one-way times, and per collective and group size.

Repeats are taken in interleaved rounds over the whole link sweep (``LinkSweep.round``; the worker
alternates them with the compute rounds), and each point reports the median of its round medians
(profilers.timing). Every rank walks the same loops with the same repeat counts, fixed by the plan
(no adaptive counts here), so the blocking calls always pair up. Small messages get many repeats:
each is tens of microseconds, and one-way latency on a loaded host is bimodal (a woken receiver
sometimes waits for the next scheduler tick), so it takes many to pin the median down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from profilers.fits import affine_fit
from profilers.timing import Meter

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw factor for ``op`` on ``n`` ranks."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class LinkPlan:
    p2p_sizes: tuple[int, ...]
    coll_sizes: tuple[int, ...]
    warmup: int
    rounds: int
    small_repeats: int
    """Repeats per round of a message of at most ``small_bytes`` (latency-bound: microseconds each) ..."""
    large_repeats: int
    """... and of a larger one (bandwidth-bound: milliseconds each)."""
    small_bytes: int = 1 << 16

    def repeats(self, size: int) -> int:
        return self.small_repeats if size <= self.small_bytes else self.large_repeats


def link_plan(device: str, quick: bool) -> LinkPlan:
    if device.startswith("cuda"):
        return LinkPlan(p2p_sizes=(8, 1 << 20, 64 << 20) if quick else (8, 1 << 16, 1 << 20, 16 << 20, 256 << 20),
                        coll_sizes=(1 << 20, 64 << 20) if quick else (1 << 16, 1 << 20, 16 << 20, 256 << 20),
                        warmup=3, rounds=3 if quick else 5, small_repeats=20, large_repeats=5)
    # The largest p2p message gives the bandwidth figure: on gloo loopback 16 MiB (one-way ~4 ms) spans
    # several scheduler ticks, so four fresh profiles agreed within 2.5% at 16 MiB against 8% at 4 MiB
    # (and two quick profiles at 4 MiB differed by 11-13% at load 1.8).
    return LinkPlan(p2p_sizes=(8, 1 << 16, 1 << 20, 16 << 20) if quick
                    else (8, 1 << 12, 1 << 16, 1 << 20, 4 << 20, 16 << 20),
                    # quick keeps 4 MiB too: its busbw (the headline) repeated within 6% where 1 MiB's
                    # varied up to 12% between quick profiles
                    coll_sizes=(1 << 16, 1 << 20, 4 << 20) if quick else (1 << 12, 1 << 16, 1 << 20, 4 << 20),
                    warmup=3 if quick else 5, rounds=5 if quick else 6,
                    small_repeats=48 if quick else 60, large_repeats=24 if quick else 16)


def group_sizes(world: int) -> list[int]:
    """2, 4, 8, ... up to the world, and the world itself."""
    out, g = [], 2
    while g <= world:
        out.append(g)
        g *= 2
    if world >= 2 and world not in out:
        out.append(world)
    return out


def pairs(world: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(world) for j in range(i + 1, world)]


def link_steps(world: int, device: str, quick: bool) -> int:
    """Progress ticks of the link sweep: one per pair and per (group, collective), every round."""
    if world < 2:
        return 0
    return link_plan(device, quick).rounds * (len(pairs(world)) + len(group_sizes(world)) * len(COLLECTIVES))


Progress = Callable[[str], None]


def _collective_fn(op: str, g: int, size: int, device: str, group) -> Callable[[], object]:
    import torch
    import torch.distributed as dist

    elems = max(g, size // 4)
    elems -= elems % g  # divisible by the group so every rank gets an equal part
    if op == "all_reduce":
        x = torch.ones(elems, device=device)
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        out = torch.empty(elems, device=device)
        part = torch.ones(elems // g, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
        return lambda: gather(out, part, group=group)
    if op == "reduce_scatter":
        inp = torch.ones(elems, device=device)
        out = torch.empty(elems // g, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=group)
    if op == "all_to_all":
        inp = torch.ones(elems, device=device)
        out = torch.empty(elems, device=device)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    raise ValueError(op)


def check_collective(op: str, g: int, rank: int, device: str, group) -> bool:
    """Run ``op`` once on rank-dependent data and compare with the hand-computed answer, so a
    benchmark never times a collective that silently does the wrong thing."""
    import torch
    import torch.distributed as dist

    n = 2 * g
    if op == "all_reduce":
        x = torch.full((n,), float(rank + 1), device=device)
        dist.all_reduce(x, group=group)
        want = torch.full((n,), g * (g + 1) / 2, device=device)
        return bool(torch.equal(x, want))
    if op == "all_gather":
        out = torch.empty(n, device=device)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
            out, torch.full((2,), float(rank), device=device), group=group)
        return bool(torch.equal(out, torch.arange(g, device=device).float().repeat_interleave(2)))
    if op == "reduce_scatter":
        out = torch.empty(2, device=device)
        inp = torch.arange(n, device=device).float() * (rank + 1)
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp, group=group)
        want = torch.arange(2 * rank, 2 * rank + 2, device=device).float() * (g * (g + 1) / 2)
        return bool(torch.equal(out, want))
    if op == "all_to_all":
        inp = torch.arange(n, device=device).float() + 100 * rank  # chunk j (2 elements) goes to rank j
        out = torch.empty(n, device=device)
        dist.all_to_all_single(out, inp, group=group)
        want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, device=device).float() + 100 * src
                          for src in range(g)])
        return bool(torch.equal(out, want))
    raise ValueError(op)


class LinkSweep:
    """This rank's part of the link sweep: ``warm()`` once, then ``round()`` as often as the plan's
    rounds (every rank the same number of times, between barriers), then ``rows()``.

    p2p: pair (i, j) at a time, rank i times ping-pongs while j echoes the same number of messages
    (``Meter.take`` makes one untimed call before each round, so j echoes one more), the other ranks
    wait at the barrier. Collectives: the members of each group time it after a group barrier.
    """

    def __init__(self, rank: int, world: int, device: str, quick: bool, tick: Progress,
                 fault: Callable[[str], None] | None = None, plan: LinkPlan | None = None):
        import torch
        import torch.distributed as dist

        self.rank, self.world, self.device, self.tick, self.fault = rank, world, device, tick, fault
        self.place: Callable[[int], None] = lambda nbytes: None
        """Called before each message size (the worker sets it: profilers.placement.CommThreads)."""
        self.plan = plan or link_plan(device, quick)
        self.dist = dist
        self.bufs = {s: torch.zeros(max(1, s // 4), dtype=torch.float32, device=device) for s in self.plan.p2p_sizes}
        self.p2p: dict[tuple[int, int, int], Meter] = {}
        for i, j in pairs(world):
            if rank == i:
                for size, buf in self.bufs.items():
                    def ping(buf=buf, peer=j):
                        dist.send(buf, peer)
                        dist.recv(buf, peer)
                    self.p2p[(i, j, size)] = Meter(ping, device=device)
        # new_group must be called by every rank, in the same order, for every group.
        self.groups = {g: (dist.new_group(list(range(g))) if g < world else dist.group.WORLD)
                       for g in group_sizes(world)}
        self.coll: dict[tuple[str, int, int], tuple[Meter, int]] = {}
        self.verified: dict[tuple[str, int], bool] = {}
        for g, group in self.groups.items():
            if rank >= g:
                continue
            for op in COLLECTIVES:
                for size in self.plan.coll_sizes:
                    real = 4 * (max(g, size // 4) - max(g, size // 4) % g)
                    self.coll[(op, g, size)] = (Meter(_collective_fn(op, g, size, device, group), device=device), real)

    def _echo(self, size: int, peer: int, n: int) -> None:
        buf = self.bufs[size]
        for _ in range(n):
            self.dist.recv(buf, peer)
            self.dist.send(buf, peer)

    def _pass(self, warm: bool) -> None:
        dist, rank, plan = self.dist, self.rank, self.plan
        for i, j in pairs(self.world):
            if self.fault is not None:
                self.fault("p2p")
            for size in plan.p2p_sizes:
                if rank in (i, j):
                    self.place(size)
                n = plan.warmup if warm else plan.repeats(size)
                if rank == i:
                    meter = self.p2p[(i, j, size)]
                    meter.warm(n) if warm else meter.take(n)
                elif rank == j:
                    self._echo(size, i, n if warm else n + 1)  # + take()'s untimed call
            dist.barrier()
            if not warm:
                self.tick(f"p2p {i}<->{j}")
        for g, group in self.groups.items():
            for op in COLLECTIVES:
                if self.fault is not None:
                    self.fault("collectives")
                if rank < g:
                    if warm:
                        self.verified[(op, g)] = check_collective(op, g, rank, self.device, group)
                    for size in plan.coll_sizes:
                        meter, _ = self.coll[(op, g, size)]
                        self.place(size)
                        dist.barrier(group=group)
                        meter.warm(plan.warmup) if warm else meter.take(plan.repeats(size))
                dist.barrier()
                if not warm:
                    self.tick(f"{op} g={g}")

    def warm(self) -> None:
        self._pass(warm=True)

    def round(self) -> None:
        self._pass(warm=False)

    def rows(self) -> list[dict]:
        rows = []
        for (i, j, size), meter in self.p2p.items():
            t = meter.timing()
            one_way = t.median_s / 2.0
            rows.append({"kind": "p2p", "params": {"src": i, "dst": j, "bytes": size}, "work": size,
                         "timing": t.to_dict(), "metrics": {"one_way_s": one_way,
                                                            "bandwidth_bytes_per_s": size / one_way}})
        for (op, g, _size), (meter, real) in self.coll.items():
            rows.append({"kind": "collective", "params": {"op": op, "group_size": g, "bytes": real},
                         "work": real, "timing": meter.timing().to_dict(),
                         "metrics": {"verified": self.verified[(op, g)]}})
        return rows


def run_links(rank: int, world: int, device: str, quick: bool, tick: Progress,
              fault: Callable[[str], None] | None = None) -> list[dict]:
    """The whole link sweep on its own (the worker interleaves its rounds with compute instead)."""
    if world < 2:
        return []
    sweep = LinkSweep(rank, world, device, quick, tick, fault)
    sweep.warm()
    for _ in range(sweep.plan.rounds):
        sweep.round()
    return sweep.rows()


def fit_links(samples: list[dict], hosts: list[str]) -> dict:
    """Matrices, nccl-tests rows and alpha-beta fits from all ranks' link samples.

    ``samples`` carry a ``rank``; a collective's time is the slowest member's median.
    """
    world = len(hosts)
    if world < 2:
        return {}
    bw = [[None] * world for _ in range(world)]
    lat = [[None] * world for _ in range(world)]
    by_pair: dict[tuple[int, int], list[dict]] = {}
    for s in samples:
        if s["kind"] == "p2p":
            by_pair.setdefault((s["params"]["src"], s["params"]["dst"]), []).append(s)
    per_class: dict[str, tuple[list[float], list[float], list[list[int]]]] = {}
    pair_fits = []
    for (i, j), rows in sorted(by_pair.items()):
        rows.sort(key=lambda s: s["params"]["bytes"])
        small, big = rows[0], rows[-1]
        lat[i][j] = lat[j][i] = small["metrics"]["one_way_s"]
        bw[i][j] = bw[j][i] = big["metrics"]["bandwidth_bytes_per_s"]
        cls = "intra" if hosts[i] == hosts[j] else "inter"
        xs, ys, prs = per_class.setdefault(cls, ([], [], []))
        xs += [s["params"]["bytes"] for s in rows]
        ys += [s["metrics"]["one_way_s"] for s in rows]
        prs.append([i, j])
        f = affine_fit([s["params"]["bytes"] for s in rows], [s["metrics"]["one_way_s"] for s in rows])
        pair_fits.append({"pair": [i, j], "class": cls, "alpha_s": f["alpha_s"], "beta_bytes_per_s": f["rate"]})
    alpha_beta = {}
    for cls, (xs, ys, prs) in per_class.items():
        f = affine_fit(xs, ys)
        alpha_beta[cls] = {"alpha_s": f["alpha_s"], "beta_bytes_per_s": f["rate"], "r2": f["r2"], "pairs": prs}
    # Collectives: slowest member's median per (op, group, bytes).
    slowest: dict[tuple[str, int, int], dict] = {}
    for s in samples:
        if s["kind"] != "collective":
            continue
        key = (s["params"]["op"], s["params"]["group_size"], s["params"]["bytes"])
        if key not in slowest or s["timing"]["median_s"] > slowest[key]["timing"]["median_s"]:
            slowest[key] = s
    table, coll = [], {}
    for (op, g, size), s in sorted(slowest.items()):
        t = s["timing"]["median_s"]
        algbw = size / t
        fac = bus_factor(op, g)
        unstable = any(x["timing"]["unstable"] for x in samples if x["kind"] == "collective"
                       and (x["params"]["op"], x["params"]["group_size"], x["params"]["bytes"]) == (op, g, size))
        verified = all(x["metrics"].get("verified", True) for x in samples if x["kind"] == "collective"
                       and (x["params"]["op"], x["params"]["group_size"]) == (op, g))
        table.append({"op": op, "group_size": g, "bytes": size, "time_s": t, "algbw_bytes_per_s": algbw,
                      "busbw_bytes_per_s": algbw * fac, "bus_factor": fac, "unstable": unstable,
                      "verified": verified})
    for op in COLLECTIVES:
        for g in sorted({r["group_size"] for r in table if r["op"] == op}):
            rows = [r for r in table if r["op"] == op and r["group_size"] == g]
            f = affine_fit([r["bytes"] for r in rows], [r["time_s"] for r in rows])
            coll.setdefault(op, {})[str(g)] = {"alpha_s": f["alpha_s"], "algbw_bytes_per_s": f["rate"],
                                               "busbw_bytes_per_s": f["rate"] * bus_factor(op, g),
                                               "bus_factor": bus_factor(op, g), "r2": f["r2"]}
    return {"p2p_bandwidth": bw, "p2p_latency": lat, "p2p_pairs": pair_fits, "alpha_beta": alpha_beta,
            "collectives": coll, "collective_table": table, "hosts": hosts}
