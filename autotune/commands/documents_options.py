"""Reading ``--data FILE --eod ID`` / ``--lengths FILE`` into the workload's documents: what
``search``, ``estimate`` and ``trial`` share. It opens token files with the runtime's reader, so it
sits with the commands (the planner's ``autotune/documents.py`` stays below the runtime)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from autotune.documents import (
    DocumentSource,
    LengthDistribution,
    lengths_from_eod,
    megatron_lengths,
    read_histogram,
)
from autotune.errors import InputError
from autotune.runtime.data import open_token_file


def documents_from_options(*, data: str | None, eod: int | None, lengths: str | None, vocab: int,
                           data_dtype: str = "auto") -> DocumentSource | None:
    """The documents that ``--data FILE --eod ID`` or ``--lengths FILE`` give (None: neither); bad
    combinations and unreadable files are InputErrors naming the option."""
    if eod is not None and data is None:
        raise InputError("needs --data (the token file whose documents end with this id)", field="--eod")
    if lengths is not None and data is not None:
        raise InputError("give --lengths FILE (a histogram, synthetic tokens) or --data FILE --eod ID, not both",
                         field="--lengths")
    if lengths is not None:
        return DocumentSource(read_histogram(lengths))
    if data is None or eod is None:
        return None
    tf = open_token_file(data, vocab, dtype=data_dtype)
    if not 0 <= eod < vocab:
        raise InputError(f"{eod} is not a token id of a vocabulary of {vocab}", field="--eod")
    if tf.fmt == "megatron":
        idx = str(Path(tf.path).with_suffix(".idx"))
        return DocumentSource(LengthDistribution.from_lengths(megatron_lengths(idx), f"megatron:{Path(idx).name}"),
                              data=tf.path, idx=idx)
    mm = np.memmap(tf.path, dtype=np.dtype(tf.dtype), mode="r", offset=tf.offset, shape=(tf.tokens,))
    found = lengths_from_eod(mm, eod)
    if len(found) < 2:
        raise InputError(f"{tf.path} holds no token {eod}: no document ends there; is --eod the right id?",
                         field="--eod")
    return DocumentSource(LengthDistribution.from_lengths(found, f"eod:{Path(tf.path).name}:{eod}"),
                          data=tf.path, eod=eod)
