"""Documents from the command line: ``--data FILE --eod ID`` and ``--lengths FILE`` on estimate,
search, trial and validate; the study records the distribution and validate runs the same windows."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.cli import cli

from autotune import documents as W

MIXED = """name: mixed-h100-a100
nodes:
  - count: 1
    devices_per_node: 8
    device: H100-SXM
    intra_node: {bandwidth: "450GB/s", latency: "3us"}
  - count: 1
    devices_per_node: 8
    device: A100-80GB
    intra_node: {bandwidth: "300GB/s", latency: "3us"}
inter_node: {bandwidth: "25GB/s", latency: "10us"}
"""


def token_file(path, mu: float, sigma: float, docs: int, vocab: int, dtype=np.uint16, eod: int = 0, seed: int = 0):
    """A flat token file of ``docs`` documents with log-normal lengths, each ending with ``eod``."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.rint(rng.lognormal(mu, sigma, docs)), 2, None).astype(int)
    parts = []
    for n in lens:
        t = rng.integers(1, vocab, size=n)
        t[-1] = eod
        parts.append(t)
    np.concatenate(parts).astype(dtype).tofile(path)
    return lens


def test_estimate_with_documents_is_cheaper_and_says_how_it_priced(tmp_path, capsys):
    h = tmp_path / "h.csv"
    h.write_text("length,count\n64,100\n512,20\n4096,1\n")
    code, out, _ = cli(capsys, "estimate", "-m", "tiny", "-c", "local:4", "-p", "dp=4,dtype=fp32", "-s", "2048",
                       "-b", "8", "--json")
    assert code == 0
    full = json.loads(out)
    code, out, _ = cli(capsys, "estimate", "-m", "tiny", "-c", "local:4", "-p", "dp=4,dtype=fp32", "-s", "2048",
                       "-b", "8", "--lengths", str(h), "--json")
    assert code == 0
    masked = json.loads(out)
    assert masked["plan"]["doc_mask"] is True
    assert masked["predicted"]["step_time_s"] < full["predicted"]["step_time_s"]
    assert masked["breakdown"]["documents"]["digest"] == W.read_histogram(h).digest()
    code, out, _ = cli(capsys, "estimate", "-m", "tiny", "-c", "local:4", "-p", "dp=4,dtype=fp32", "-s", "2048",
                       "-b", "8", "--lengths", str(h), "--no-doc-mask", "--json")
    assert json.loads(out)["predicted"]["step_time_s"] == full["predicted"]["step_time_s"]


@pytest.mark.parametrize("args,field", [
    (["--eod", "0"], "--eod"),
    (["--lengths", "MISSING"], "--lengths"),
    (["--doc-mask"], "--doc-mask"),
    (["-p", "dp=4,doc_mask=1"], "--doc-mask"),
])
def test_bad_document_options_are_one_line_errors(tmp_path, capsys, args, field):
    base = ["estimate", "-m", "tiny", "-c", "local:4", "-s", "256", "-b", "8"]
    if "-p" not in args:
        base += ["-p", "dp=4"]
    code, _, err = cli(capsys, *base, *args)
    assert code == 2 and field in err and "Traceback" not in err


def test_eod_that_never_occurs_is_refused(tmp_path, capsys):
    f = tmp_path / "t.bin"
    np.arange(1, 200, dtype=np.uint16).tofile(f)
    code, _, err = cli(capsys, "estimate", "-m", "tiny", "-c", "local:4", "-p", "dp=4", "-s", "32", "-b", "8",
                       "--data", str(f), "--eod", "0")
    assert code == 2 and "--eod" in err and "no document ends" in err


@pytest.mark.slow  # two searches of 40 trials (~40 s), one process
def test_search_on_a_mixed_cluster_at_a_long_window_moves_with_the_distribution(tmp_path, capsys):
    """Llama-3-8B, 32k window, 8 H100 + 8 A100: with short documents (median ~245 tokens, log-normal
    mu 5.5, sigma 1.0, bench_varlen's shape) attention stops being what sequence sharding is for, and
    the best plan changes (with median ~1k tokens and sigma 1.6 it no longer did once the GPU prices
    counted the runtime's kernels); the study records the distribution."""
    (tmp_path / "mixed.yaml").write_text(MIXED)
    f = tmp_path / "long.bin"
    token_file(f, 5.5, 1.0, 3000, 1000, dtype=np.uint32)
    common = ["search", "-m", "llama3-8b", "-c", str(tmp_path / "mixed.yaml"), "-s", "32768", "-b", "16",
              "--storage", f"sqlite:///{tmp_path}/s.db", "--trials", "40", "--json"]
    code, out, err = cli(capsys, *common)
    assert code == 0, err
    fixed = json.loads(out)
    code, out, err = cli(capsys, *common, "--data", str(f), "--eod", "0", "--data-dtype", "uint32")
    assert code == 0, err
    docs = json.loads(out)
    assert docs["best"]["doc_mask"] is True and "doc_mask" not in fixed["best"]
    assert docs["study"] != fixed["study"]
    key = ("degrees", "shares", "balance")
    assert [docs["best"].get(k) for k in key] != [fixed["best"].get(k) for k in key]
    from autotune.study import open_study, study_documents

    rec = study_documents(open_study(docs["study"], f"sqlite:///{tmp_path}/s.db"))
    assert rec.eod == 0 and rec.data == str(f.resolve()) and rec.dist.tokens == f.stat().st_size // 4


@pytest.mark.slow
def test_trial_and_validate_run_the_searched_plan_on_the_same_documents(tmp_path, capsys):
    """On two local processes: search a tiny model over an EOD file, validate the best plan (it
    trains on that file's windows, masked) and trial it again by hand with the same options."""
    f = tmp_path / "t.bin"
    token_file(f, 4.0, 1.0, 400, 256)
    store = f"sqlite:///{tmp_path}/s.db"
    code, out, err = cli(capsys, "search", "-m", "tiny", "-c", "local:2", "-s", "256", "-b", "4", "--dtype", "fp32",
                         "--data", str(f), "--eod", "0", "--storage", store, "--trials", "8", "--json")
    assert code == 0, err
    res = json.loads(out)
    code, out, err = cli(capsys, "validate", "--study", res["study"], "--storage", store, "--top", "1",
                         "--steps", "1", "--warmup", "0", "--json")
    assert code == 0, err
    row = json.loads(out)["validated"][0]
    assert row["failure"] is None and row["measured"]["data"] == str(f.resolve())
    lengths = W.lengths_from_eod(np.fromfile(f, dtype=np.uint16), 0)
    assert row["measured"]["documents"]["digest"] == W.LengthDistribution.from_lengths(lengths).digest()
    plan = tmp_path / "best.json"
    plan.write_text(json.dumps(row["plan"]))
    code, out, err = cli(capsys, "trial", "-p", str(plan), "-m", "tiny", "-s", "256", "-b", "4", "--data", str(f),
                         "--eod", "0", "--steps", "1", "--warmup", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["measured"]["documents"] == row["measured"]["documents"]
