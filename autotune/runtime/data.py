"""Training data for trials: a learnable synthetic stream, or the user's token file; sliced by the plan.

Every sample of a step is a window of ``seq_len + 1`` token ids (inputs and the next tokens as
targets). A *source* hands out any rows ``[first, last)`` of step ``step``'s global batch, and a
row's tokens depend only on (step, row), never on who asks: so each rank reads only its DP
replica's samples (``shares.samples``, replicas in index order) and every layout trains on the
same numbers as the single-process reference. The rank then keeps the tokens at its global
positions (CP shard and Ulysses slice, from ``local_token_positions``).

Sources:

* ``SyntheticStream`` (the default): a Markov chain whose next token is the current one plus one
  of four fixed offsets, the first taken 70% of the time. Its entropy is 0.94 nats a token against
  ln(vocab) for uniform noise, and a model learns the offsets within a few steps, so the loss falls
  (uniform tokens start at the floor ln(vocab) and cannot). Cumulative sums make it vectorised.
* ``TokenFile``: a flat array of token ids on disk, as nanoGPT writes ``train.bin`` (uint16, or
  uint32 for vocabularies past 65,536) and as Megatron's indexed datasets write ``PREFIX.bin``
  beside ``PREFIX.idx`` (whose header gives the dtype; documents are concatenated, which is how
  GPT pre-training reads them). It is opened with ``numpy.memmap`` in each rank; a rank copies
  out only its own windows. Window ``w = step * global_batch + row`` starts at token
  ``(w mod n) * seq_len`` with ``n = (tokens - 1) // seq_len`` windows, so the file is read in
  order and wraps around when a run needs more.

``open_token_file`` and ``check_token_file`` run in the launching process before any rank starts:
a missing, empty, wrongly typed or too-short file, or token ids the model's vocabulary does not
have, is an ``InputError`` (one line, exit 2 in the CLI).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from autotune.errors import InputError
from autotune.plan import Plan
from autotune.token_files import (  # noqa: F401  (their old home: ``from autotune.runtime.data import ...``)
    DTYPES,
    FIELD,
    IDX_DTYPES,
    IDX_MAGIC,
    TokenFile,
    _idx_dtype,
    _megatron_paths,
    open_token_file,
)

MARKOV_OFFSETS = (1, 3, 7, 12)
MARKOV_PROBS = (0.7, 0.1, 0.1, 0.1)


# ---- sources ------------------------------------------------------------------------------------
class SyntheticStream:
    """The default data: the offset Markov chain of the module docstring, rows drawn from (seed, step, row)."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed = vocab, seed
        self._offsets = torch.tensor(MARKOV_OFFSETS)
        self._probs = torch.tensor(MARKOV_PROBS)

    def row(self, step: int, row: int, seq_len: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_048_573 + row)
        start = torch.randint(0, self.vocab, (1,), generator=g)
        moves = self._offsets[torch.multinomial(self._probs, seq_len, replacement=True, generator=g)]
        return (start + torch.cat([moves.new_zeros(1), moves.cumsum(0)])) % self.vocab

    def rows(self, step: int, first: int, last: int, global_batch: int, seq_len: int) -> torch.Tensor:
        """Token ids ``[last - first, seq_len + 1]`` of rows ``first..last-1`` of step ``step``."""
        return torch.stack([self.row(step, r, seq_len) for r in range(first, last)])


class FileStream:
    """Rows of a ``TokenFile``, read through a memmap opened once per process."""

    def __init__(self, tf: TokenFile):
        self.file = tf
        self._mm: np.memmap | None = None

    def rows(self, step: int, first: int, last: int, global_batch: int, seq_len: int) -> torch.Tensor:
        if self._mm is None:
            self._mm = self.file.memmap()
        out = np.empty((last - first, seq_len + 1), dtype=np.int64)
        for i, r in enumerate(range(first, last)):
            s = self.file.window_start(step, r, global_batch, seq_len)
            out[i] = self._mm[s:s + seq_len + 1]
        return torch.from_numpy(out)


def source_from(desc: dict[str, Any] | None, vocab: int, seed: int) -> SyntheticStream | FileStream:
    """The source a trial payload names (``None``: the synthetic stream of ``seed``)."""
    return SyntheticStream(vocab, seed) if desc is None else FileStream(TokenFile.from_dict(desc))


def synthetic_tokens(seed: int, vocab: int, global_batch: int, seq_len: int, step: int = 0) -> torch.Tensor:
    """The default stream's whole global batch ``[global_batch, seq_len + 1]`` of step ``step``."""
    return SyntheticStream(vocab, seed).rows(step, 0, global_batch, global_batch, seq_len)


# ---- slicing by the plan ------------------------------------------------------------------------
def replica_range(plan: Plan, dp_index: int) -> tuple[int, int]:
    """``[start, end)`` of the global batch that DP replica ``dp_index`` trains on."""
    samples = plan.shares.samples
    assert samples is not None, "resolve the plan first"
    start = sum(samples[:dp_index])
    return start, start + samples[dp_index]


def local_batch(tokens: torch.Tensor, plan: Plan, dp_index: int,
                positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each ``[samples of the replica, S_local]``: this rank's slice of a step
    from the whole global batch ``tokens``."""
    start, end = replica_range(plan, dp_index)
    return inputs_targets(tokens[start:end], positions)


def replica_batch(source: SyntheticStream | FileStream, step: int, plan: Plan, dp_index: int,
                  positions: torch.Tensor | None, global_batch: int,
                  seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``local_batch`` reading only the replica's own rows from ``source``."""
    start, end = replica_range(plan, dp_index)
    return inputs_targets(source.rows(step, start, end, global_batch, seq_len), positions)


def inputs_targets(rows: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of windows ``[n, seq_len + 1]``, kept at this rank's ``positions``."""
    inputs, targets = rows[:, :-1], rows[:, 1:]
    if positions is not None:
        inputs, targets = inputs[:, positions], targets[:, positions]
    return inputs.contiguous(), targets.contiguous()


def split_microbatches(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` equal micro-batches along the batch dimension (as the pipeline schedules split)."""
    return list(x.tensor_split(n, dim=0))


def check_token_file(tf: TokenFile, vocab: int, seq_len: int, global_batch: int, steps: int) -> None:
    """The file holds one window and every token the run will read is an id of the model."""
    if tf.tokens < seq_len + 1:
        raise InputError(f"{tf.path} holds {tf.tokens} tokens; a sequence of {seq_len} needs at least "
                         f"{seq_len + 1}", field=FIELD)
    mm = tf.memmap()
    seen = min(steps * global_batch, tf.windows(seq_len))  # windows repeat after that
    starts = sorted({tf.window_start(0, w, global_batch, seq_len) for w in range(seen)})
    looks_uint32 = tf.dtype == "uint16" and tf.fmt == "flat"
    for s in starts:
        win = np.asarray(mm[s:s + seq_len + 1])
        bad = np.flatnonzero((win < 0) | (win >= vocab))
        if bad.size:
            i = s + int(bad[0])
            hint = ("; is it a uint16 file read as uint32? pass --data-dtype uint16"
                    if tf.dtype == "uint32" and tf.fmt == "flat" else "")
            raise InputError(f"{tf.path}: token {i} is {int(win[bad[0]])}, not an id of a vocabulary of "
                             f"{vocab}{hint}", field=FIELD)
        first_odd = 1 - s % 2  # the high halves of little-endian uint32 tokens sit at odd offsets
        looks_uint32 = looks_uint32 and not win[first_odd::2].any()
    if looks_uint32 and tf.tokens >= 4:
        raise InputError(f"{tf.path}: every second uint16 token is 0, as in a file of uint32 tokens; "
                         "pass --data-dtype uint32", field=FIELD)


def prepare_data(path: str | os.PathLike[str] | None, vocab: int, seq_len: int, global_batch: int,
                 steps: int, *, dtype: str = "auto") -> dict[str, Any] | None:
    """The payload entry for ``--data PATH`` (None without it), checked for a run of ``steps`` steps."""
    if path is None:
        if dtype != "auto":
            raise InputError("only goes with --data", field="--data-dtype")
        return None
    tf = open_token_file(path, vocab, dtype=dtype)
    check_token_file(tf, vocab, seq_len, global_batch, steps)
    return tf.to_dict()
