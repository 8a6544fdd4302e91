"""Training data (autotune/runtime/data.py): the synthetic stream and token files, against references:
Megatron-core's own indexed-dataset writer and reader, numpy slicing of the whole file, the
whole-batch slicing the equivalence tests use; then every bad file as one line, exit 2, no process."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from helpers.cli import cli

from autotune.errors import InputError
from autotune.plan import Plan
from autotune.runtime import data as D
from autotune.specs import local_cluster
from autotune.specs.model import load_model

VOCAB = 256


def plan_dp(samples, seq_len=16, batch=4):
    return Plan.from_dict({"degrees": {"dp": len(samples)}, "shares": {"samples": list(samples)}}).resolve(
        load_model("tiny"), local_cluster(len(samples)), seq_len, batch)


def test_synthetic_rows_depend_only_on_step_and_row():
    s = D.SyntheticStream(VOCAB, seed=3)
    whole = s.rows(2, 0, 8, 8, 32)
    assert whole.shape == (8, 33)
    assert torch.equal(D.SyntheticStream(VOCAB, seed=3).rows(2, 3, 6, 8, 32), whole[3:6])
    assert not torch.equal(s.rows(3, 0, 8, 8, 32), whole)  # a fresh batch every step
    assert not torch.equal(D.SyntheticStream(VOCAB, seed=4).rows(2, 0, 8, 8, 32), whole)


def test_synthetic_stream_is_the_documented_markov_chain():
    rows = D.synthetic_tokens(0, VOCAB, 64, 256)
    moves = (rows[:, 1:] - rows[:, :-1]) % VOCAB
    counts = {m: int((moves == m).sum()) for m in D.MARKOV_OFFSETS}
    assert sum(counts.values()) == moves.numel()
    share = counts[D.MARKOV_OFFSETS[0]] / moves.numel()
    assert share == pytest.approx(D.MARKOV_PROBS[0], abs=0.02)
    entropy = -sum(p * math.log(p) for p in D.MARKOV_PROBS)
    assert entropy < 0.25 * math.log(VOCAB)  # learnable: far below uniform noise's floor


def test_replica_batch_reads_the_same_tokens_as_slicing_the_whole_batch():
    plan = plan_dp([3, 1])
    pos = torch.tensor([0, 5, 9])
    src = D.SyntheticStream(VOCAB, 0)
    whole = src.rows(1, 0, 4, 4, 16)
    for dp_index in (0, 1):
        for positions in (None, pos):
            a = D.replica_batch(src, 1, plan, dp_index, positions, 4, 16)
            b = D.local_batch(whole, plan, dp_index, positions)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    x, y = D.local_batch(whole, plan, 1, pos)
    assert torch.equal(x[0], whole[3, [0, 5, 9]]) and torch.equal(y[0], whole[3, [1, 6, 10]])


def write_flat(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype=dtype).tofile(path)  # what nanoGPT's prepare.py does
    return path


def test_flat_file_windows_are_consecutive_slices_of_the_file(tmp_path):
    tokens = np.random.default_rng(0).integers(0, VOCAB, 1000)
    f = D.open_token_file(write_flat(tmp_path / "train.bin", tokens), VOCAB)
    assert (f.fmt, f.dtype, f.tokens) == ("flat", "uint16", 1000)
    rows = D.FileStream(f).rows(0, 0, 4, 4, 64)
    for i in range(4):
        assert rows[i].tolist() == tokens[i * 64:i * 64 + 65].tolist()
    # the file wraps when a run needs more windows than it holds: (1000 - 1) // 64 = 15 windows
    again = D.FileStream(f).rows(4, 0, 4, 4, 64)  # windows 16..19 = 1..4
    assert again[0].tolist() == tokens[64:129].tolist()


def test_vocab_past_uint16_reads_uint32(tmp_path):
    big = 100_000
    tokens = np.random.default_rng(1).integers(0, big, 300)
    f = D.open_token_file(write_flat(tmp_path / "t.bin", tokens, np.uint32), big)
    assert f.dtype == "uint32"
    D.check_token_file(f, big, 32, 2, 3)
    assert D.FileStream(f).rows(0, 1, 2, 2, 32)[0].tolist() == tokens[32:65].tolist()


def test_megatron_indexed_dataset_read_as_megatron_reads_it(tmp_path):
    idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, VOCAB, n) for n in (50, 7, 130, 64)]
    prefix = str(tmp_path / "corpus_text_document")
    builder = idx_mod.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(prefix + ".idx")
    reader = idx_mod.IndexedDataset(prefix)
    stream = np.concatenate([reader[i] for i in range(len(reader))])  # Megatron's GPT datasets concatenate
    for given in (prefix, prefix + ".bin", prefix + ".idx"):
        f = D.open_token_file(given, VOCAB)
        assert (f.fmt, f.dtype, f.tokens) == ("megatron", "int32", len(stream))
    rows = D.FileStream(f).rows(0, 0, 3, 3, 40)
    for i in range(3):
        assert rows[i].tolist() == stream[i * 40:i * 40 + 41].tolist()


def test_a_rank_reads_only_its_own_windows(tmp_path):
    f = D.open_token_file(write_flat(tmp_path / "train.bin", np.arange(10_000) % VOCAB), VOCAB)
    touched = []

    class Recorder:
        def __init__(self, mm):
            self.mm = mm

        def __getitem__(self, key):
            touched.append((key.start, key.stop))
            return self.mm[key]

    src = D.FileStream(f)
    src._mm = Recorder(f.memmap())
    plan = plan_dp([3, 1], seq_len=32, batch=4)
    D.replica_batch(src, 2, plan, 1, None, 4, 32)  # step 2, replica 1 holds row 3: window 2*4+3 = 11
    assert touched == [(11 * 32, 12 * 32 + 1)]


# ---- bad files: one line, exit 2, before any process starts ------------------------------------
def bad_files(tmp_path):
    write_flat(tmp_path / "ok.bin", np.arange(5000) % VOCAB)
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    write_flat(tmp_path / "big_ids.bin", np.full(5000, 300))
    write_flat(tmp_path / "short.bin", np.arange(100))
    write_flat(tmp_path / "u32.bin", np.arange(5000) % VOCAB, np.uint32)
    (tmp_path / "dir.bin").mkdir()
    (tmp_path / "floats.bin").write_bytes(np.zeros(5000, np.float32).tobytes())
    (tmp_path / "floats.idx").write_bytes(D.IDX_MAGIC + (1).to_bytes(8, "little") + bytes([7]))
    (tmp_path / "noidx.idx").write_bytes(b"not an index")
    return {
        "missing.bin": "does not exist",
        "empty.bin": "is empty",
        "odd.bin": "not a whole number of uint16 tokens",
        "big_ids.bin": "is 300, not an id of a vocabulary of 256",
        "short.bin": "needs at least 129",
        "u32.bin": "every second uint16 token is 0",
        "dir.bin": "is not a file",
        "floats.bin": "tokens are float32",
        "noidx.idx": "not a Megatron index file",
    }


def test_bad_files_are_input_errors(tmp_path):
    for name, words in bad_files(tmp_path).items():
        with pytest.raises(InputError) as e:
            D.prepare_data(tmp_path / name, VOCAB, 128, 8, 22)
        assert words in e.value.message and e.value.field == "--data", name
    assert D.prepare_data(tmp_path / "ok.bin", VOCAB, 128, 8, 22)["tokens"] == 5000
    assert D.prepare_data(tmp_path / "u32.bin", VOCAB, 128, 8, 22, dtype="uint32")["dtype"] == "uint32"
    with pytest.raises(InputError, match="read as uint32"):
        D.prepare_data(tmp_path / "ok.bin", VOCAB, 128, 8, 22, dtype="uint32")
    with pytest.raises(InputError, match="only goes with --data"):
        D.prepare_data(None, VOCAB, 128, 8, 22, dtype="uint32")




def test_trial_cli_refuses_bad_files_before_launching(tmp_path, capsys, monkeypatch):
    import autotune.runtime.launcher as launcher

    def no_launch(*a, **k):
        raise AssertionError("a process was started for a bad data file")

    monkeypatch.setattr(launcher, "launch", no_launch)
    (tmp_path / "plan.json").write_text('{"degrees": {"dp": 2}}')
    for name, words in bad_files(tmp_path).items():
        code, out, err = cli(capsys, "trial", "-p", str(tmp_path / "plan.json"), "-m", "tiny", "-s", "128",
                             "-b", "8", "--steps", "20", "--data", str(tmp_path / name))
        assert code == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "--data" in lines[0] and words in " ".join(err.split()), (name, err)


def test_validate_and_tune_refuse_a_bad_file_before_any_trial(tmp_path, capsys):
    import os

    sys.path.insert(0, os.path.dirname(__file__))
    from _search_helpers import toy_estimate

    from autotune.search import SearchOptions, search
    from autotune.specs import load_cluster
    from autotune.validate import ValidateOptions, validate

    url = str(tmp_path / "v.log")
    search(load_model("tiny"), load_cluster("local:2"), 128, 8, study_name="v", storage=url,
           options=SearchOptions(trials=5), estimator=toy_estimate)

    def runner(*a, **k):
        raise AssertionError("a trial started for a bad data file")

    bad = bad_files(tmp_path)
    for name in ("short.bin", "big_ids.bin"):
        with pytest.raises(InputError) as e:
            validate("v", url, options=ValidateOptions(data=str(tmp_path / name)), runner=runner,
                     estimator=toy_estimate)
        assert bad[name] in e.value.message and e.value.field == "--data"
    # tune checks the file before it profiles or searches anything
    code, out, err = cli(capsys, "tune", "-m", "tiny", "-s", "128", "-b", "8", "--no-profile", "--storage",
                         str(tmp_path / "t.log"), "--data", str(tmp_path / "odd.bin"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "whole number" in err, err
    assert not (tmp_path / "t.log").exists()
