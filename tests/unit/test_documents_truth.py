"""What a plan priced over documents says is true, and priced at the cost of a few plain estimates
(issues 39 and 40): the windows drawn as numpy's ``choice`` draws them, the vectorised work against
the loops it replaced, each distribution's work computed once, MFU on the masked workload's FLOPs,
one step time whose parts add up, ``--target``'s kernels reaching the drawn steps, every search path
pricing masks, and the distribution said in the terminal and the JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.cli import cli

from autotune import documents as W
from autotune.cost import documents as DOC
from autotune.cost.documents_estimator import DocumentsEstimator
from autotune.cost.estimate import estimate
from autotune.plan import Plan
from autotune.specs import load_model
from autotune.specs.cluster import cluster_from_dict

TINY = load_model("tiny")
SHORT = W.lognormal(5.0, 1.2, n=4000, seed=1)  # median ~150 tokens: many documents per window


def _gpus(n: int = 8, device: str = "H100-SXM") -> object:
    return cluster_from_dict({"name": f"g{n}", "nodes": [{"count": 1, "devices_per_node": n, "device": device}]})


def _choice_window(dist, seq_len, rng):
    """The reference: a window drawn with ``Generator.choice`` (the implementation before arrays were
    cached and draws located with one ``searchsorted``)."""
    lengths = np.asarray(dist.lengths, dtype=np.int64)
    counts = np.asarray(dist.counts, dtype=np.float64)
    biased = lengths * counts
    first = int(rng.choice(lengths, p=biased / biased.sum()))
    residual = int(first - rng.integers(0, first))
    if residual >= seq_len:
        return (seq_len,)
    out, total = [residual], residual
    while total < seq_len:
        for d in rng.choice(lengths, size=2 * (seq_len - total) // max(1, int(dist.mean())) + 4,
                            p=counts / counts.sum()):
            out.append(int(d))
            total += int(d)
            if total >= seq_len:
                break
    out[-1] -= total - seq_len
    return tuple(out)


@pytest.mark.parametrize("dist", [SHORT, W.LengthDistribution((32, 4096), (12800, 100)),
                                  W.LengthDistribution((7,), (1,)), W.lognormal(7.6, 1.0, n=3000, seed=2)])
def test_windows_are_the_ones_numpy_choice_draws(dist):
    for seq in (1, 300, 4096, 32768):
        rng_a, rng_b = np.random.default_rng([seq, 1]), np.random.default_rng([seq, 1])
        for _ in range(12):  # one generator over many windows: the stream is consumed alike
            assert W.sample_window(dist, seq, rng_a) == _choice_window(dist, seq, rng_b)


def _loop_attn_seq(windows, segs, shard, seq_len):
    """The reference loop of ``_attn_seq`` (pair-weighted mean piece length over a whole window's)."""
    def weighted(ws):
        num = den = 0.0
        for docs in ws:
            for s, e in DOC.W_starts(docs):
                for a, n in segs:
                    piece = min(e, a + n) - max(s, a)
                    if piece > 0:
                        pairs = piece * (piece + 1) / 2.0
                        num += pairs * piece
                        den += pairs
        return num / den if den else 0.0

    whole = weighted([(seq_len,)])
    return min(float(shard), shard * weighted(windows) / whole) if whole else float(shard)


@pytest.mark.parametrize("tokens,zig,samples,balance", [
    ((2048,), False, (2, 2, 2, 2), "count"), ((1024, 1024), True, (4, 4), "cost"),
    ((768, 1280), False, (8,), "count"), ((512, 512, 512, 512), True, (3, 5), "cost")])
def test_vectorised_step_work_is_the_loops_figures(tokens, zig, samples, balance):
    from autotune.cost.ring import segments

    step = DOC.drawn_steps(SHORT, 2048, 8, 2, 0)[1]
    work = DOC._step_work(step, samples, balance, tokens, zig, 2048, False)
    segs = segments(tokens, zig, 2048)
    for i, rows in enumerate(W.replica_rows(step, samples, balance)):
        pairs = np.array([[DOC.masked_pairs(step[r], segs[c]) for c in range(len(tokens))] for r in rows])
        sync = float(pairs.max(axis=1).mean() / pairs.mean(axis=0).max()) if len(tokens) > 1 else 1.0
        assert work.keysums[i] == tuple(float(x) * sync for x in pairs.mean(axis=0))
        assert work.attn_seq[i] == tuple(_loop_attn_seq([step[r] for r in rows], segs[c], tokens[c], 2048)
                                         for c in range(len(tokens)))


@pytest.mark.parametrize("tokens,zig", [((2048,), False), ((1024, 1024), True), ((768, 1280), False),
                                        ((320, 192, 512, 1024), True)])
def test_run_sums_are_the_per_piece_figures(tokens, zig):
    """The summary's per-window sums over runs of pieces (``documents_summary._rank_sums``) against
    ``documents._Pieces.of_ranks`` piece by piece on the same drawn windows: equal pairs, the
    attention-length weights to float64 rounding."""
    from autotune.cost import documents_summary as SUM
    from autotune.cost.ring import segments

    for dist in (SHORT, W.LengthDistribution((32, 2048), (6400, 50)), W.lognormal(7.6, 1.0, n=3000, seed=2)):
        steps = DOC.drawn_steps(dist, 2048, 8, DOC.DRAWS, DOC.SEED)
        pieces = DOC._Pieces.of(tuple(w for st in steps for w in st))
        segs = segments(tokens, zig, 2048)
        for sg, got in zip(segs, SUM._rank_sums(SUM._pieces(dist, 2048, 8), segs, 2048), strict=True):
            want = pieces.of_ranks(sg)
            assert np.array_equal(got[0], want[0].astype(float))
            for g, w in zip(got[1:], want[1:], strict=True):
                assert np.allclose(g, w.astype(float), rtol=1e-12, atol=0)


@pytest.mark.parametrize("samples", [(4, 4), (3, 5), (1, 1, 6), (0, 8), (8,), (2, 1, 3, 2)])
@pytest.mark.parametrize("balance", ["count", "cost"])
def test_every_step_is_dealt_as_the_runtime_deals_it(samples, balance):
    """The summary's dealing of all drawn steps at once (``documents_summary._labels``) against
    ``documents.replica_rows`` step by step (what every rank of a trial computes)."""
    from autotune.cost import documents_summary as SUM

    for dist in (SHORT, W.LengthDistribution((32, 2048), (6400, 50))):
        lab = SUM._labels(dist, 2048, 8, samples, balance)
        for d, step in enumerate(DOC.drawn_steps(dist, 2048, 8, DOC.DRAWS, DOC.SEED)):
            for r, rows in enumerate(W.replica_rows(step, samples, balance)):
                assert list(np.flatnonzero(lab[d] == r)) == sorted(rows)


def test_a_distribution_is_worked_once_per_window_shape():
    """Two plans that differ only where the documents do not reach (tp) share their drawn work, their
    summarised works and their replicas' pairs; the distribution's draw arrays are built once."""
    c = _gpus()
    a = Plan.from_dict({"degrees": {"dp": 2, "tp": 4}}).resolve(TINY, c, 2048, 8)
    b = Plan.from_dict({"degrees": {"dp": 2, "tp": 2, "pp": 2}}).resolve(TINY, c, 2048, 8)
    first, second = DOC.drawn_work(a, SHORT, 2048, 8, False), DOC.drawn_work(b, SHORT, 2048, 8, False)
    assert all(x is y for x, y in zip(first, second, strict=True))
    from autotune.cost import documents_summary as SUM

    assert SUM.works(a, SHORT, 2048, 8, False) is SUM.works(b, SHORT, 2048, 8, False)
    x = SUM.replica_pairs(a, SHORT, 2048, 8, SUM.works(a, SHORT, 2048, 8, False))
    assert x is SUM.replica_pairs(b, SHORT, 2048, 8, SUM.works(b, SHORT, 2048, 8, False))
    assert SHORT.sampler is SHORT.sampler


@pytest.mark.parametrize("deg", [{"dp": 8}, {"dp": 2, "cp": 2, "tp": 2}, {"cp": 8}])
def test_mfu_counts_the_masked_workload(deg):
    """MFU at most 100%, fewer model FLOPs with masks than without, and the FLOPs of a workload whose
    windows each hold one document (nothing masked) those of the plain estimate."""
    c, seq = _gpus(), 8192
    plan = Plan.from_dict({"degrees": deg, "doc_mask": True})
    masked = estimate(plan, TINY, c, seq, 8, documents=SHORT)
    plain = estimate(plan.replace(doc_mask=False), TINY, c, seq, 8)
    f = masked.breakdown["flops"]
    assert f["model_per_step"] < plain.breakdown["flops"]["model_per_step"] == f["unmasked_model_per_step"]
    assert masked.predicted["mfu"] == pytest.approx(
        f["model_per_step"] / (masked.predicted["step_time_s"] * f["cluster_peak_per_s"]), rel=1e-12)
    assert 0 < masked.predicted["mfu"] <= 1.0
    whole = estimate(plan, TINY, c, seq, 8, documents=DOC.GivenWindows((((seq,),) * 8,)))
    assert whole.breakdown["flops"]["model_per_step"] == pytest.approx(plain.breakdown["flops"]["model_per_step"])


def test_mfu_of_long_windows_of_short_documents_stays_below_one():
    """Issue 39's case: llama2-7b on 64 H20 at 128k tokens with documents of median ~2k tokens
    (its search reported MFU 1.51)."""
    c = cluster_from_dict({"name": "h20", "nodes": [{"count": 8, "devices_per_node": 8, "device": "H20"}],
                           "inter_node": {"bandwidth": "50GB/s"}})
    dist = W.lognormal(float(np.log(2000)), 1.0, n=3000, seed=0)
    for deg in ({"dp": 16, "tp": 4}, {"dp": 8, "cp": 2, "tp": 4}, {"dp": 4, "cp": 4, "tp": 4}):
        est = DocumentsEstimator(dist)(Plan.from_dict({"degrees": deg}), load_model("llama2-7b"), c, 131072, 16)
        assert 0 < est.predicted["mfu"] <= 1.0, (deg, est.predicted["mfu"])


@pytest.mark.parametrize("deg", [{"dp": 4, "tp": 2}, {"dp": 2, "pp": 2, "tp": 2}, {"dp": 2, "cp": 2, "tp": 2}])
def test_one_step_time_whose_parts_add_up(deg):
    """With documents the headline is the mean over drawn steps: the breakdown is that step too
    (its terms add up to it as a plain estimate's do), and every stage ends with it."""
    c = _gpus()
    est = DocumentsEstimator(SHORT)(Plan.from_dict({"degrees": deg}), TINY, c, 4096, 16, timeline=True)
    step, bd = est.predicted["step_time_s"], est.breakdown
    assert bd["step_time_s"] == step == bd["documents"]["step_time_s"]
    parts = bd["compute_s"] + bd["exposed_comm_s"] + bd["dp_exposed_s"] + bd["bubble_s"] + bd["optimizer_s"]
    assert parts == pytest.approx(step, rel=1e-9)
    assert max(s["end_s"] for s in bd["stages"]) == pytest.approx(step, rel=1e-9)
    assert max(e["end"] for e in bd["timeline"]) <= step * (1 + 1e-9)
    from autotune.commands.search import why

    p = {"predicted": est.predicted}
    assert why(p, bd, p, bd).startswith("fastest: ")


def test_the_documents_estimator_prices_the_targets_kernels():
    from autotune.search.pricing import Evaluator
    from autotune.targets import kernel_costs

    c, plan = _gpus(), Plan.from_dict({"degrees": {"dp": 8}})
    k = kernel_costs("megatron")
    got = DocumentsEstimator(SHORT)(plan, TINY, c, 4096, 8, kernels=k)
    want = estimate(got.plan, TINY, c, 4096, 8, documents=SHORT, kernels=k)  # the balance it chose
    own = DocumentsEstimator(SHORT)(plan, TINY, c, 4096, 8)
    assert got.predicted["step_time_s"] == want.predicted["step_time_s"] != own.predicted["step_time_s"]

    class Space:
        ctx = None

    assert Evaluator(Space(), DocumentsEstimator(SHORT), target="megatron").kernels is not None


def test_a_search_with_a_step_time_limit_prices_the_documents(tmp_path):
    """A plain cluster with --max-step-time takes the pool path: its plans are priced with masks too,
    as the study's name (-docs<digest>) says."""
    from autotune.objective import make_objective
    from autotune.search import SearchOptions
    from autotune.search.pool import pool_search

    c = _gpus()
    src = W.DocumentSource(SHORT)
    opts = SearchOptions(trials=12, documents={**src.record(), "doc_mask": True}, doc_mask=True)
    res = pool_search(TINY, c, 4096, 8, study_name="s", storage=":memory:", options=opts,
                      objective=make_objective("time", None, "100s", c))
    assert res.best is not None and res.best.plan.doc_mask


def test_the_distribution_is_in_the_terminal_and_the_json(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("name: g8\nnodes:\n  - {count: 1, devices_per_node: 8, device: H100-SXM}\n")
    h = tmp_path / "h.csv"
    h.write_text("length,count\n" + "".join(f"{a},{b}\n" for a, b in zip(SHORT.lengths, SHORT.counts, strict=True)))
    dist = W.read_histogram(h)
    base = ["-m", "tiny", "-c", str(tmp_path / "c.yaml"), "-s", "4096", "-b", "8", "--lengths", str(h)]
    code, out, err = cli(capsys, "search", *base, "--trials", "8", "--storage", f"sqlite:///{tmp_path}/s.db", "--json")
    assert code == 0, err
    d = json.loads(out)["documents"]
    assert (d["documents"], d["p50"], d["p90"], d["digest"]) == (dist.documents, dist.quantile(0.5),
                                                                 dist.quantile(0.9), dist.digest())
    assert "lengths" not in d  # the distribution's figures, not its histogram
    code, out, err = cli(capsys, "search", *base, "--trials", "8", "--storage", f"sqlite:///{tmp_path}/s.db")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("documents:"))  # one line, however wide
    assert f"{dist.documents:,} documents" in line and dist.digest()[:8] in line
    code, out, err = cli(capsys, "estimate", *base, "-p", "dp=8")
    assert code == 0, err
    text = " ".join(out.split())
    assert f"median {dist.quantile(0.5):,} tokens" in text and "MFU counts" in text


def test_prepared_windows_are_the_feeds_and_draw_nothing_in_the_step(monkeypatch):
    from autotune.runtime.documents import DocumentFeed

    feed = DocumentFeed(SHORT.to_payload(), None, seed=3)
    want = [feed.docs(st, 0, 8, 8, 1024) for st in range(3)]
    feed.prepare(range(3), 8, 1024)
    monkeypatch.setattr(W, "sample_window", lambda *a, **k: pytest.fail("a window drawn inside the step"))
    assert [feed.docs(st, 0, 8, 8, 1024) for st in range(3)] == want
    assert feed.docs(1, 2, 5, 8, 1024) == want[1][2:5]


def test_a_trial_draws_its_windows_before_the_timed_steps(monkeypatch, tmp_path):
    """``worker.train`` (one rank on a gloo group of one) finds every step's windows before its first
    step: no window is drawn while a step runs, where calibration would read the host's drawing as
    compute; the steps run on the windows the feed draws."""
    import datetime

    import torch
    import torch.distributed as dist

    from autotune.runtime import worker
    from autotune.specs import local_cluster

    inside = {"step": False, "drawn_in_step": 0, "drawn": 0, "steps": 0}
    real_draw, real_step = W.sample_window, worker.RankTrainer.step

    def draw(*a, **k):
        inside["drawn"] += 1
        inside["drawn_in_step"] += inside["step"]
        return real_draw(*a, **k)

    def step(self, i):
        inside["step"], inside["steps"] = True, inside["steps"] + 1
        try:
            return real_step(self, i)
        finally:
            inside["step"] = False

    monkeypatch.setattr(W, "sample_window", draw)
    monkeypatch.setattr(worker.RankTrainer, "step", step)
    plan = Plan.from_dict({"degrees": {}, "dtype": "fp32"}).resolve(TINY, local_cluster(1), 64, 4)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        out = worker.train(plan, TINY, 64, 4, steps=2, warmup=1, seed=0, device=torch.device("cpu"),
                           documents=W.LengthDistribution((5, 40), (3, 1)).to_payload())
    finally:
        dist.destroy_process_group()
    assert inside["steps"] == 3 and len(out["step_times"]) == 2
    assert inside["drawn"] == 3 * 4 and inside["drawn_in_step"] == 0


def test_the_dashboard_says_why_its_best_is_not_the_fastest_row():
    from types import SimpleNamespace as NS

    from autotune.dashboard.terminal import _best_why

    simple = NS(number=3, feasible=True, predicted_tps=990.0, measured_tps=None)
    fastest = NS(number=7, feasible=True, predicted_tps=1000.0, measured_tps=None)
    view = NS(best=simple, rows=[fastest, simple])
    assert "#7" in _best_why(view) and "1%" in _best_why(view)
    assert _best_why(NS(best=fastest, rows=[fastest, simple])) == ""


def test_a_trial_over_documents_says_so_in_the_terminal(capsys):
    """trial --data --eod / --lengths prints the documents it ran on, as search and estimate do (issue
    39 item 6; the JSON is checked in tests/integration/test_documents_cli.py)."""
    from autotune.commands.trial import _show

    m = {"step_time_s": 1.0, "tokens_per_s": 1024.0, "peak_memory_bytes": [1], "warmup": 0, "data": None,
         "time_split": [{"rank": 0, "compute_s": 0.9, "comm_s": 0.0, "idle_s": 0.1, "coverage": 1.0}],
         "documents": {**SHORT.brief(), "balance": "count"}}
    _show({"measured": m, "losses": [5.0]})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("documents:"))
    assert f"{SHORT.documents:,} documents" in line and f"median {SHORT.quantile(0.5):,} tokens" in line
    assert SHORT.digest()[:8] in line and "masked" in line
