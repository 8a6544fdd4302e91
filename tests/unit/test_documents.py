"""Document masks on one process: the per-document kernels against a dense masked reference, and a
masked packed window against its documents run one by one (loss and gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autotune import documents as W
from autotune.runtime import ring_attention as R
from autotune.runtime.documents import (
    DocumentFeed,
    dense_mask,
    doc_attention,
    doc_attention_backward,
    doc_attention_with_lse,
    split_docs,
)
from autotune.runtime.helix import attention_backward, attention_with_lse
from autotune.runtime.model import StageModel, init_weights, unsharded_layout
from autotune.specs import load_model
from autotune.specs.model import ModelSpec

DOCS = ((5, 1, 10, 8), (24,), (3, 3, 3, 15))


def _qkv(b=3, h=4, s=24, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, generator=g, requires_grad=True) for _ in range(3)]


def test_doc_attention_matches_a_dense_masked_sdpa_forward_and_backward():
    q, k, v = _qkv()
    out = doc_attention(q, k, v, DOCS)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(DOCS))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_kept_attention_kernels_per_document_match_the_dense_reference():
    """HelixPipe keeps (output, lse) and runs the backward kernel per document."""
    q, k, v = (t.detach() for t in _qkv(seed=1))
    o, lse = doc_attention_with_lse(q, k, v, DOCS, attention_with_lse)
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense_mask(DOCS))
    torch.testing.assert_close(o, ref.detach(), atol=1e-5, rtol=1e-5)
    do = torch.randn_like(o)
    got = doc_attention_backward(do, q, k, v, o, lse, DOCS, attention_backward)
    want = torch.autograd.grad(ref, (qq, kk, vv), do)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_ring_blocks_cut_by_documents_match_the_dense_reference_on_one_shard(fused, monkeypatch):
    """The ring on one shard runs the document sub-blocks of ``block_pairs`` (both block kernels)."""
    monkeypatch.setattr(R, "USE_FUSED", fused)
    q, k, v = _qkv(seed=2)
    index = torch.arange(4)
    out = R.ring_attention(q, k, v, index, [[(0, 24)]], 0, None, (0,), DOCS)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(DOCS))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _model(spec, seq_len, seed=7):
    m = StageModel(spec, unsharded_layout(), list(range(spec.layers)), first=True, last=True, seq_len=seq_len)
    init_weights(m, spec, seed)
    return m


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("arch", [{}, {"norm": "layernorm", "position": "learned", "max_positions": 32, "bias": True,
                                      "activation": "gelu", "tied_embeddings": True}], ids=["llama", "opt"])
def test_masked_window_loss_is_the_token_weighted_mean_of_its_documents_run_one_by_one(arch):
    """The window's loss (mean over its tokens, as the runtime defines it) equals the token-weighted
    mean of the documents' losses, each run alone from position 0; the gradients are equal too.
    With a learned position table (OPT-style) each document starts at row 0 of it."""
    spec = ModelSpec(name="t", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, vocab=64, **arch)
    docs = (7, 1, 12, 4)
    s = sum(docs)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, spec.vocab, (1, s + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    window = _model(spec, s)
    window.docs = (docs,)
    loss = window.token_losses(window(x), y).mean()
    loss.backward()
    total, grads = 0.0, None
    start = 0
    for n in docs:  # each document alone, positions 0..n-1, with its own targets from the window
        m = _model(spec, n)
        part = m.token_losses(m(x[:, start:start + n]), y[:, start:start + n]).sum() / s
        part.backward()
        total += float(part.detach())
        grads = _grads(m) if grads is None else {k: grads[k] + v for k, v in _grads(m).items()}
        start += n
    assert float(loss.detach()) == pytest.approx(total, rel=1e-5)
    for name, grad in _grads(window).items():
        torch.testing.assert_close(grad, grads[name], atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    # and the mask matters: without it the same window's loss differs
    window.docs = None
    assert float(window.token_losses(window(x), y).mean()) != pytest.approx(total, rel=1e-4)


def test_the_feed_reads_documents_from_eod_tokens_and_draws_them_from_a_histogram(tmp_path):
    from autotune.runtime.data import FileStream, open_token_file

    eod = 0
    arr = np.array([5, 6, eod, 7, eod, 8, 9, 9, 9, eod, 3, 3, eod, 4, 4, 4, 4, 4] * 4, dtype=np.uint16)
    path = tmp_path / "train.bin"
    arr.tofile(path)
    tf = open_token_file(path, 16)
    feed = DocumentFeed({"eod": eod}, FileStream(tf), seed=0)
    docs = feed.docs(0, 0, 2, 2, 8)
    assert docs == ((3, 2, 3), (2, 3, 3))  # window 0: [5 6 E][7 E][8 9 9]; window 1: [9 E][3 3 E][4 4 4]
    dist = W.LengthDistribution((2, 30), (5, 1))
    synth = DocumentFeed(dist.to_payload(), None, seed=4)
    a = synth.docs(3, 0, 4, 4, 16)
    assert a == synth.docs(3, 0, 4, 4, 16) and all(sum(r) == 16 for r in a)
    assert synth.docs(3, 2, 3, 4, 16) == a[2:3]  # a row's documents do not depend on who asks
    assert split_docs(a, 2) == [a[:2], a[2:]]


def test_lengths_from_eod_and_a_histogram_file(tmp_path):
    toks = np.array([1, 2, 0, 3, 0, 0, 4, 5, 6])
    assert list(W.lengths_from_eod(toks, 0)) == [3, 2, 1, 3]
    f = tmp_path / "h.csv"
    f.write_text("length,count\n100, 3\n# a comment\n7\t2\n100 1\n")
    d = W.read_histogram(f)
    assert d.lengths == (7, 100) and d.counts == (2, 4) and d.tokens == 414
    assert W.LengthDistribution.from_summary(d.summary()) == d
    commented = tmp_path / "c.csv"  # a header after comment lines is still the header
    commented.write_text("# where the lengths came from\n\nlength,count\n7,2\n100,4\n")
    assert W.read_histogram(commented).counts == d.counts
    bad = tmp_path / "bad.csv"
    bad.write_text("100,3\nx,y\n")
    with pytest.raises(W.InputError, match="bad.csv:2"):
        W.read_histogram(bad)
    late = tmp_path / "late.csv"  # only the first line may be a header
    late.write_text("length,count\n100,3\nlength,count\n")
    with pytest.raises(W.InputError, match="late.csv:3"):
        W.read_histogram(late)


def test_sampled_windows_tile_the_window_and_follow_the_distribution():
    """A data-order window's pieces sum to the window; with documents much shorter than it the mean
    piece (all but the cut ones) is the distribution's mean."""
    dist = W.lognormal(4.0, 0.5, n=5000, seed=1)
    rng = np.random.default_rng(0)
    pieces = []
    for _ in range(300):
        w = W.sample_window(dist, 1024, rng)
        assert sum(w) == 1024 and min(w) >= 1
        pieces += list(w[1:-1])
    assert np.mean(pieces) == pytest.approx(dist.mean(), rel=0.05)
    assert W.sample_window(W.LengthDistribution((5000,), (1,)), 1024, rng) == (1024,)


def test_megatron_index_lengths_group_sequences_by_document(tmp_path):
    import struct

    seq = np.array([3, 4, 5, 6], dtype=np.int32)
    docs = np.array([0, 1, 3, 4], dtype=np.int64)  # documents: [3], [4, 5], [6]
    with open(tmp_path / "d.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<QQ", 4, 4))
        f.write(seq.tobytes() + np.zeros(4, dtype=np.int64).tobytes() + docs.tobytes())
    assert list(W.megatron_lengths(tmp_path / "d.idx")) == [3, 9, 6]
    assert W.docs_between(np.cumsum([3, 9, 6]), 2, 8) == (1, 7)


def test_tiny_preset_runs_with_documents_on_one_process():
    from autotune.runtime.worker import reference_run

    spec = load_model("tiny")
    dist = W.LengthDistribution((3, 9, 40), (4, 2, 1))
    plain = reference_run(spec, 32, 4, steps=2, seed=0)
    masked = reference_run(spec, 32, 4, steps=2, seed=0, documents=dist.to_payload())
    assert plain["losses"][0] != pytest.approx(masked["losses"][0], rel=1e-6)
    assert all(np.isfinite(masked["losses"]))


def test_windows_dealt_by_cost_keep_the_counts_and_beat_the_order_on_a_skewed_step():
    docs = [(64,), (64,), (8,) * 8, (8,) * 8, (64,), (32, 32), (8,) * 8, (16,) * 4]
    for samples in ([4, 4], [2, 6], [2, 2, 2, 2]):
        dealt = W.replica_rows(docs, samples, "cost")
        assert sorted(i for r in dealt for i in r) == list(range(len(docs)))
        assert [len(r) for r in dealt] == samples
        assert worst(docs, dealt, samples) <= worst(docs, W.replica_rows(docs, samples, "count"), samples)
    sorted_step, even = [(64,)] * 4 + [(8,) * 8] * 4, [4, 4]  # the long documents all at the front
    assert (worst(sorted_step, W.replica_rows(sorted_step, even, "cost"), even)
            < 0.6 * worst(sorted_step, W.replica_rows(sorted_step, even, "count"), even))


def worst(docs, deal, samples):
    """The largest attention work per sample over the replicas."""
    return max(sum(W.attention_pairs(docs[i]) for i in r) / n for r, n in zip(deal, samples, strict=True))


def test_plan_fields_of_schema_3_are_written_only_when_set():
    from autotune.plan import Plan, PlanError

    old = Plan.from_dict({"schema_version": 2, "degrees": {"dp": 2}})
    assert "doc_mask" not in old.to_dict() and "balance" not in old.to_dict()
    new = Plan.from_dict({"degrees": {"dp": 2}, "doc_mask": True, "balance": "cost"})
    assert Plan.from_dict(new.to_dict()) == new and new.to_dict()["schema_version"] == 3
    with pytest.raises(PlanError, match="balance"):
        Plan.from_dict({"degrees": {"dp": 2}, "balance": "sizes"})


def test_megatron_document_lengths_as_megatron_reads_them(tmp_path):
    """Documents of several sequences each, written by Megatron's own builder: our lengths are its
    reader's documents (sequence lengths summed between its document indices)."""
    idx_mod = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(3)
    prefix = str(tmp_path / "c_text_document")
    builder = idx_mod.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for parts in ([5, 9], [40], [3, 3, 3], [17]):
        builder.add_document(torch.tensor(rng.integers(0, 50, sum(parts))), parts)
    builder.finalize(prefix + ".idx")
    reader = idx_mod.IndexedDataset(prefix)
    di, sl = reader.document_indices, reader.sequence_lengths
    want = [int(sl[di[i]:di[i + 1]].sum()) for i in range(len(di) - 1)]
    assert list(W.megatron_lengths(prefix + ".idx")) == want == [14, 40, 9, 17]
