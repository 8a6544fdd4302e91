"""What every foreign-format reader shares (``profilers/foreign/sailor.py``, ``metis.py``,
``galvatron.py``): the command line's context, one-line errors naming the file, number and mapping
checks, the layer-profile document they all return.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import InputError

MiB = 2.0**20


@dataclass
class ImportContext:
    """What the command line adds to a foreign file."""

    model: Any
    """The ModelSpec the profile was measured on (its shape gates where the cost model uses it)."""
    device: str | None = None
    """Catalogue device name the files were measured on (None: inferred from the file where it can be)."""
    seq: int | None = None
    """Sequence length of the measurement where the format does not record it."""
    dtype: str | None = None
    """Precision of the measurement where the format does not record it."""


def fail(path: str | Path, message: str, field: str | None = None) -> InputError:
    return InputError(message, source=str(path), field=field)


def number(v: Any, path: str | Path, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        raise fail(path, f"expected a non-negative number, got {v!r}", field)
    return float(v)


def as_mapping(v: Any, path: str | Path, field: str | None, what: str) -> dict:
    if not isinstance(v, dict):
        raise fail(path, f"expected {what}, got {type(v).__name__}", field)
    return v


def document(fmt: str, ctx: ImportContext, device: str, dtype: str, points: list[dict], sources: list[str],
             assumed: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A layer-profile document from converted points (validated again by the store)."""
    from profilers.layers import LAYER_DOC_KIND, LAYER_SCHEMA_VERSION, LAYER_UNITS, model_dict

    return {"kind": LAYER_DOC_KIND, "schema_version": LAYER_SCHEMA_VERSION, "units": LAYER_UNITS,
            "device_kind": "cuda", "device_name": device, "model": model_dict(ctx.model), "dtype": dtype,
            "origin": fmt, "source": ", ".join(sources),
            "meta": {"format": fmt, "files": sources, "assumed": assumed, **(extra or {})},
            "points": sorted(points, key=lambda p: (p["piece"], p["tp"], p["micro_batch"], p["seq"]))}


ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def activation_precision(points: list[dict], dtype: str, measured: str | None, why: str) -> list[str]:
    """The ``assumed`` line for activation bytes measured in another precision than the profile is
    labelled with (an fp32 run imported as ``--dtype fp16``): stored as measured, so the cost model
    scales to them as they are; the line says so and by how much a ``dtype`` run would differ."""
    if measured is None or measured == dtype or not any("activation_bytes" in p for p in points):
        return []
    ratio = ELEMENT_BYTES[measured] / ELEMENT_BYTES[dtype]
    return [f"activation bytes measured in {measured} ({why}), not in the {dtype} this profile is labelled: "
            f"stored as measured, about {ratio:g}x what a {dtype} run holds"]


def need(value: Any, option: str, fmt: str, what: str) -> Any:
    if value is None:
        raise InputError(f"{fmt} files do not record {what}; give it with {option}", field=option)
    return value


def load_json(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(path, f"not a readable JSON file ({str(e).splitlines()[0]})") from None
