"""Document masks for packed windows: attention stops at document boundaries (Llama 3's packing).

A packed window of ``S`` tokens holds several documents (or pieces of them) one after the other. A
row's documents are given by their lengths, in position order, summing to ``S``: ``Docs`` is one
such tuple per row of a micro-batch. A query at global position ``p`` sees the key at ``p'`` when
``p' <= p`` (causal) and both lie in the same document.

Positions are *not* restarted per document: rotary embeddings (the runtime's only position
encoding) make a score depend on ``p - p'`` alone, and the mask only keeps pairs inside one
document, so a document's attention is the same at any offset (up to rounding): the loss of a
masked window is the token-weighted mean of its documents' losses run one by one, which
``tests/unit/test_documents.py`` checks. Llama 3 also keeps positions running (its paper: "an
attention mask that prevents self-attention between different documents within the same
sequence"). A learned absolute position table is indexed from 0 at every document start instead
(``model.positions_in_documents``), so the same holds for it.

Every attention path runs one fused causal kernel per document piece (a loop over documents), so
the work really is the sum of squared document lengths that ``autotune/cost/documents.py`` prices.
torch 2.13's ``flex_attention`` imports on CPU but needs ``torch.compile`` to skip masked blocks;
eager it builds the dense ``S x S`` scores, which is the cost of the unmasked window.

``block_pairs`` cuts a (query segment, key segment) block of the CP ring into the sub-blocks that
one document spans, which is how the ring and Ulysses carry the boundaries: every rank knows every
row's documents (it reads them from the data, as it reads its tokens), so nothing extra travels.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

Docs = tuple[tuple[int, ...], ...]
"""Per row of a micro-batch, the lengths of its documents in position order (summing to the window)."""

CAUSAL = "causal"
"""Sub-block kind: the same positions for queries and keys (top-left causal mask)."""


def check_docs(docs: Docs, rows: int, seq_len: int) -> None:
    if len(docs) != rows:
        raise ValueError(f"document lengths for {len(docs)} rows, the batch has {rows}")
    for i, row in enumerate(docs):
        if sum(row) != seq_len or min(row, default=0) < 1:
            raise ValueError(f"row {i}: document lengths {list(row)[:8]}... do not tile a window of {seq_len}")


def doc_starts(row: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` global positions of each document of a row."""
    out, s = [], 0
    for n in row:
        out.append((s, s + n))
        s += n
    return out


def split_docs(docs: Docs, n: int) -> list[Docs]:
    """``docs`` cut into ``n`` micro-batches as ``tensor_split`` cuts the batch dimension."""
    idx = torch.arange(len(docs)).tensor_split(n)
    return [tuple(docs[int(i)] for i in part) for part in idx]


def doc_ids(docs: Docs) -> torch.Tensor:
    """Document index of every position ``[B, S]`` (for masks in tests and references)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in docs])


def dense_mask(docs: Docs) -> torch.Tensor:
    """Boolean ``[B, 1, S, S]``: causal and the same document (the reference the loops must match)."""
    ids = doc_ids(docs)
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]


# ---- whole window on one rank --------------------------------------------------------------------
def doc_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Docs) -> torch.Tensor:
    """Masked causal attention of whole windows: q/k/v ``[B, H, S, D]`` (kv already expanded to the
    query heads). One causal SDPA per document piece; autograd goes through the slices."""
    rows = []
    # split, not slices: a split's backward concatenates the pieces' gradients once, where every
    # slice's backward would write its gradient into a zero tensor of the whole window
    for row, qb, kb, vb in zip(docs, q.split(1), k.split(1), v.split(1), strict=True):
        parts = [F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
                 for qd, kd, vd in zip(qb.split(row, dim=2), kb.split(row, dim=2), vb.split(row, dim=2), strict=True)]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


def doc_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Docs,
                           kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel(q, k, v) -> (o, lse)`` (causal) run per document piece; (o ``[B,H,S,D]``, lse ``[B,H,S]``)."""
    os_, ls = [], []
    for b, row in enumerate(docs):
        po, pl = zip(*[kernel(q[b:b + 1, :, s:e].contiguous(), k[b:b + 1, :, s:e].contiguous(),
                              v[b:b + 1, :, s:e].contiguous()) for s, e in doc_starts(row)], strict=True)
        os_.append(torch.cat(po, dim=2))
        ls.append(torch.cat(pl, dim=2))
    return torch.cat(os_, dim=0), torch.cat(ls, dim=0)


def doc_attention_backward(do, q, k, v, o, lse, docs: Docs, kernel_backward):
    """dq, dk, dv of ``doc_attention_with_lse`` from its kept output and lse, per document piece."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b, row in enumerate(docs):
        for s, e in doc_starts(row):
            c = [t[b:b + 1, :, s:e].contiguous() for t in (do, q, k, v, o)]
            gq, gk, gv = kernel_backward(*c, lse[b:b + 1, :, s:e].contiguous())
            dq[b:b + 1, :, s:e], dk[b:b + 1, :, s:e], dv[b:b + 1, :, s:e] = gq, gk, gv
    return dq, dk, dv


# ---- ring blocks ---------------------------------------------------------------------------------
def block_pairs(qseg: tuple[int, int], kseg: tuple[int, int], kind, docs: Docs
                ) -> Iterator[tuple[int, tuple[int, int], tuple[int, int], object]]:
    """Sub-blocks of one ring block (query segment ``qseg``, key segment ``kseg``, both ``(start,
    length)`` in global positions, ``kind`` as ``ring_attention._pairs`` gives it) under document
    masks: ``(row, (q_lo, q_hi), (k_lo, k_hi), sub_kind)`` with offsets local to the segments.
    ``sub_kind`` is None (all keys visible), ``CAUSAL`` (the same positions) or a boolean mask."""
    qs, ql = qseg
    ks, kl = kseg
    for b, row in enumerate(docs):
        if kind is None or isinstance(kind, str):
            for s, e in doc_starts(row):
                q_lo, q_hi = max(s, qs), min(e, qs + ql)
                k_lo, k_hi = max(s, ks), min(e, ks + kl)
                if q_lo < q_hi and k_lo < k_hi:
                    sub = None if kind is None else CAUSAL
                    yield b, (q_lo - qs, q_hi - qs), (k_lo - ks, k_hi - ks), sub
        else:  # a partially overlapping block (no layout of ours makes one): the mask and the documents
            ids = doc_ids((row,))[0]
            same = ids[qs:qs + ql, None] == ids[None, ks:ks + kl]
            mask = kind & same
            if bool(mask.any()):
                yield b, (0, ql), (0, kl), mask


# ---- which documents a window holds ---------------------------------------------------------------
class DocumentFeed:
    """Each row's document pieces for the trainers, from the trial payload's ``documents`` entry:
    ``{"eod": ID}`` (pieces end after each EOD token of the window's inputs), ``{"megatron_idx":
    PATH}`` (the index's document ends), or ``{"lengths": [...], "counts": [...]}`` (synthetic data:
    windows of a data-order stream drawn from the histogram by (seed, step, row),
    ``autotune.documents.sample_window``). Every rank computes the same pieces for a row, whichever
    rank it is, so the boundaries reach every CP/HP/PP rank without a message."""

    def __init__(self, desc: dict, source, seed: int):
        from autotune import documents as W

        self.desc, self.source, self.seed = dict(desc), source, seed
        self._ends = None
        self._dist = None
        self._ready: dict[int, Docs] = {}  # step -> every row's pieces, drawn by ``prepare``
        if "lengths" in desc:
            self._dist = W.LengthDistribution(tuple(desc["lengths"]), tuple(desc["counts"]), desc.get("source", ""))
        elif "megatron_idx" in desc:
            import numpy as np

            self._ends = np.cumsum(W.megatron_lengths(desc["megatron_idx"]))
        elif "eod" not in desc:
            raise ValueError(f"documents entry needs eod, megatron_idx or lengths, got {sorted(desc)}")

    def prepare(self, steps: range, global_batch: int, seq_len: int) -> None:
        """Find every row's pieces of ``steps`` now, before the trial's first step: drawing a global
        batch of windows (or reading its tokens for their EODs) is the data loader's host work, and
        inside the timed step calibration would read it as compute (0.4-0.9 s a step at a global
        batch of 256 before ``sample_window`` drew with one ``searchsorted``)."""
        for st in steps:
            self._ready[st] = self.docs(st, 0, global_batch, global_batch, seq_len)

    def docs(self, step: int, first: int, last: int, global_batch: int, seq_len: int,
             rows: torch.Tensor | None = None) -> Docs:
        """Pieces of rows ``first..last-1`` of step ``step``; ``rows``: their tokens when already read."""
        from autotune import documents as W

        ready = self._ready.get(step)
        if ready is not None:
            return ready[first:last]
        if self._dist is not None:
            return tuple(W.sample_window(self._dist, seq_len, W.window_rng(self.seed, step, r))
                         for r in range(first, last))
        if self._ends is not None:
            tf = self.source.file
            return tuple(W.docs_between(self._ends, tf.window_start(step, r, global_batch, seq_len), seq_len)
                         for r in range(first, last))
        if rows is None:
            rows = self.source.rows(step, first, last, global_batch, seq_len)
        eod = int(self.desc["eod"])
        return tuple(W.docs_of_window(row[:-1].numpy(), eod) for row in rows)


def replica_step(feed: DocumentFeed | None, source, step: int, plan, dp_index: int, global_batch: int,
                 seq_len: int, positions: torch.Tensor | None, n_micro: int):
    """(inputs, targets, each micro-batch's document pieces or None) of DP replica ``dp_index``.

    Without documents, or with ``plan.balance == "count"``, the replica reads its rows in order
    (``data.replica_batch``); with ``cost`` every rank deals the step's windows by attention cost
    (``autotune.documents.replica_rows``) from the documents of the whole step and reads only its
    own rows."""
    from autotune import documents as W
    from autotune.runtime import data as D

    if feed is None:
        x, y = D.replica_batch(source, step, plan, dp_index, positions, global_batch, seq_len)
        return x, y, None
    if plan.balance != "cost":
        x, y = D.replica_batch(source, step, plan, dp_index, positions, global_batch, seq_len)
        start, end = D.replica_range(plan, dp_index)
        return x, y, split_docs(feed.docs(step, start, end, global_batch, seq_len), n_micro)
    every = feed.docs(step, 0, global_batch, global_batch, seq_len)
    rows = W.replica_rows(every, plan.shares.samples, "cost")[dp_index]
    tokens = torch.cat([source.rows(step, r, r + 1, global_batch, seq_len) for r in rows])
    x, y = D.inputs_targets(tokens, positions)
    return x, y, split_docs(tuple(every[r] for r in rows), n_micro)
