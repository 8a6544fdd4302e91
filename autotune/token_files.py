"""Token files on disk, read without torch: a flat array of token ids (nanoGPT's ``train.bin``:
uint16, or uint32 for larger vocabularies) or a Megatron ``.bin`` with its ``.idx`` (whose header
names the dtype). ``open_token_file`` finds the format and dtype and checks the size; the runtime
reads the rows (``autotune/runtime/data.py``) and the document lengths are read from the same file
(``autotune/documents.py``), so neither imports the other for it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from autotune.errors import InputError

FIELD = "--data"
DTYPES = ("auto", "uint16", "uint32")
"""What ``--data-dtype`` takes for a flat file (a Megatron ``.idx`` names its own dtype)."""

# Megatron-core's indexed dataset (megatron/core/datasets/indexed_dataset.py): the header of PREFIX.idx
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}


@dataclass(frozen=True)
class TokenFile:
    """A flat token array on disk (see the module docstring); travels to the ranks as a dict."""

    path: str
    dtype: str
    tokens: int
    offset: int = 0
    """Bytes before the first token (0 for the formats read today)."""
    fmt: str = "flat"
    """``flat`` (nanoGPT-style) or ``megatron`` (PREFIX.bin + PREFIX.idx)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenFile:
        return cls(**d)

    def windows(self, seq_len: int) -> int:
        return (self.tokens - 1) // seq_len

    def window_start(self, step: int, row: int, global_batch: int, seq_len: int) -> int:
        return ((step * global_batch + row) % self.windows(seq_len)) * seq_len

    def memmap(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", offset=self.offset,
                         shape=(self.tokens,))


# ---- opening and checking a token file (launching process, before any rank) --------------------
def _megatron_paths(path: Path) -> tuple[Path, Path] | None:
    """(PREFIX.bin, PREFIX.idx) when ``path`` names a Megatron indexed dataset, else None."""
    if path.suffix == ".idx":
        return path.with_suffix(".bin"), path
    if path.suffix == ".bin" and path.with_suffix(".idx").exists():
        return path, path.with_suffix(".idx")
    if not path.exists() and Path(str(path) + ".bin").exists():  # Megatron's --data-path PREFIX
        return Path(str(path) + ".bin"), Path(str(path) + ".idx")
    return None


def _idx_dtype(idx: Path) -> str:
    if not idx.is_file():
        raise InputError(f"{idx} is missing (a Megatron .bin needs its .idx for the token dtype)", field=FIELD)
    with open(idx, "rb") as f:
        head = f.read(len(IDX_MAGIC) + 9)
    if len(head) < len(IDX_MAGIC) + 9 or not head.startswith(IDX_MAGIC):
        raise InputError(f"{idx} is not a Megatron index file (no MMIDIDX header)", field=FIELD)
    code = head[len(IDX_MAGIC) + 8]
    (version,) = struct.unpack("<Q", head[len(IDX_MAGIC):len(IDX_MAGIC) + 8])
    if version != 1:
        raise InputError(f"{idx}: Megatron index version {version}; version 1 is read", field=FIELD)
    name = IDX_DTYPES.get(code)
    if name is None:
        raise InputError(f"{idx}: unknown token dtype code {code}", field=FIELD)
    return name


def open_token_file(path: str | os.PathLike[str], vocab: int, *, dtype: str = "auto") -> TokenFile:
    """Find the format and dtype of a token file and check its size; InputError when unusable."""
    if dtype not in DTYPES:
        raise InputError(f"expected one of {', '.join(DTYPES)}, got {dtype!r}", field="--data-dtype")
    p = Path(path).expanduser()
    mega = _megatron_paths(p)
    if mega is not None:
        binary, idx = mega
        name, fmt = _idx_dtype(idx), "megatron"
        if dtype != "auto" and dtype != name:
            raise InputError(f"{idx} says the tokens are {name}, not {dtype}", field="--data-dtype")
        if name.startswith("float"):
            raise InputError(f"{idx} says the tokens are {name}; token ids must be integers", field=FIELD)
    else:
        binary, fmt = p, "flat"
        name = dtype if dtype != "auto" else ("uint16" if vocab <= 2**16 else "uint32")
    if not binary.exists():
        raise InputError(f"{binary} does not exist", field=FIELD)
    if not binary.is_file():
        raise InputError(f"{binary} is not a file", field=FIELD)
    size, item = binary.stat().st_size, np.dtype(name).itemsize
    if size == 0:
        raise InputError(f"{binary} is empty", field=FIELD)
    if size % item:
        raise InputError(f"{binary} has {size} bytes, not a whole number of {name} tokens ({item} bytes "
                         "each); is it a token file of another dtype?", field=FIELD)
    return TokenFile(path=str(binary.resolve()), dtype=name, tokens=size // item, fmt=fmt)
