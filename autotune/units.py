"""Quantities with explicit units: bytes, bandwidth, time, FLOP/s.

Files write ``"450GB/s"``, ``"400Gbit/s"``, ``"80GiB"``, ``"3us"``. One rule, the same for numbers and
strings: **a value must carry its unit**. A bare number (``latency: 3``) or a string without a unit
(``"3"``) is refused with a line naming the field and the units it takes, because a silent default
unit once turned ``latency: 3`` (meant as microseconds) into an 86,690 s step. The one unitless value
accepted is zero, which is zero in every unit. Decimal prefixes are powers of 1000, binary ones (KiB,
MiB, GiB, TiB) powers of 1024, ``bit``/``b`` divides by 8.
"""

from __future__ import annotations

import math
import re

from autotune.errors import InputError

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}

_BYTES_RE = re.compile(rf"^\s*{_NUM}\s*([kKMGTP]i?)?(B|bit|b)\s*$")
_BW_RE = re.compile(rf"^\s*{_NUM}\s*([kKMGTP]i?)?(B|bit|b|bps)\s*(/s|ps)?\s*$")
_TIME_RE = re.compile(rf"^\s*{_NUM}\s*(ns|us|µs|ms|s|min|h)\s*$")
_FLOPS_RE = re.compile(rf"^\s*{_NUM}\s*([kKMGTP])?(FLOP/s|FLOPS|flops|FLOP|flop/s)\s*$")
_TIME = {"s": 1.0, "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "min": 60.0, "h": 3600.0}


_BYTE_UNITS = "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB, bit, Gbit"
_BW_UNITS = "B/s, MB/s, GB/s, TB/s, GiB/s, Mbit/s, Gbit/s, Gbps"
_TIME_UNITS = "ns, us, ms, s, min, h"
_FLOPS_UNITS = "FLOP/s, GFLOP/s, TFLOP/s, PFLOP/s"
_EXAMPLES = {_BYTE_UNITS: "80GiB", _BW_UNITS: "450GB/s", _TIME_UNITS: "3us", _FLOPS_UNITS: "989TFLOP/s"}


def _prefix(p: str | None) -> float:
    if not p:
        return 1.0
    return _BIN[p] if p.endswith("i") else _DEC[p]


def _check(value: float, field: str | None, what: str, allow_zero: bool) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise InputError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, got {value!r}",
                         field=field)
    return float(value)


_ZERO_RE = re.compile(r"^\s*0*\.?0*\s*$")


def _number(value: object, field: str | None, what: str, allow_zero: bool, units: str) -> float | None:
    """Reject what carries no unit; return 0.0 for a bare zero (when zero is allowed), else None
    (the caller parses the string)."""
    if isinstance(value, bool):
        raise InputError(f"expected a {what}, got a boolean", field=field)
    bare = isinstance(value, (int, float)) or (isinstance(value, str) and value.strip() != ""
                                                and re.fullmatch(rf"\s*{_NUM}\s*", value) is not None)
    if bare:
        number = float(value)  # type: ignore[arg-type]
        if number == 0 and allow_zero:
            return 0.0
        raise InputError(f"{value!r} has no unit; write the {what} with one of {units} (e.g. "
                         f"{_EXAMPLES[units]!r})", field=field)
    if not isinstance(value, str):
        raise InputError(f"expected a {what} such as the examples in the docs, got {type(value).__name__}",
                         field=field)
    return None


def parse_bytes(value: object, field: str | None = None, allow_zero: bool = False) -> float:
    """``"80GiB"`` -> 85899345920.0; ``"24GB"`` -> 24e9; a bare number is refused (module docstring)."""
    n = _number(value, field, "size", allow_zero, _BYTE_UNITS)
    if n is not None:
        return n
    m = _BYTES_RE.match(value)  # type: ignore[arg-type]
    if not m:
        raise InputError(f"bad size {value!r}; write e.g. '80GiB' or '24GB'", field=field)
    num, pre, unit = m.groups()
    bits = unit in ("bit", "b")
    return _check(float(num) * _prefix(pre) / (8 if bits else 1), field, "size", allow_zero)


def parse_bandwidth(value: object, field: str | None = None) -> float:
    """``"450GB/s"`` -> 4.5e11 bytes/s; ``"400Gbit/s"`` / ``"400Gbps"`` -> 5e10; a bare number is refused."""
    n = _number(value, field, "bandwidth", False, _BW_UNITS)
    if n is not None:
        return n
    m = _BW_RE.match(value)  # type: ignore[arg-type]
    if not m or (m.group(3) in ("B", "bit", "b") and not m.group(4)):
        raise InputError(f"bad bandwidth {value!r}; write e.g. '450GB/s' or '400Gbit/s'",
                         field=field)
    num, pre, unit, _ = m.groups()
    bits = unit in ("bit", "b", "bps")
    return _check(float(num) * _prefix(pre) / (8 if bits else 1), field, "bandwidth", False)


def parse_time(value: object, field: str | None = None, allow_zero: bool = True) -> float:
    """``"3us"`` -> 3e-6 s; a bare number other than 0 is refused."""
    n = _number(value, field, "time", allow_zero, _TIME_UNITS)
    if n is not None:
        return n
    m = _TIME_RE.match(value)  # type: ignore[arg-type]
    if not m:
        raise InputError(f"bad time {value!r}; write e.g. '3us' or '10ms'", field=field)
    return _check(float(m.group(1)) * _TIME[m.group(2)], field, "time", allow_zero)


def parse_flops(value: object, field: str | None = None) -> float:
    """``"989TFLOP/s"`` -> 9.89e14; a bare number is refused."""
    n = _number(value, field, "throughput", False, _FLOPS_UNITS)
    if n is not None:
        return n
    m = _FLOPS_RE.match(value)  # type: ignore[arg-type]
    if not m:
        raise InputError(f"bad throughput {value!r}; write e.g. '989TFLOP/s' or '312TFLOPS'", field=field)
    return _check(float(m.group(1)) * _DEC[m.group(2) or ""], field, "throughput", False)


def fmt_bytes(n: float) -> str:
    """Binary units for memory: 61.0GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def fmt_bandwidth(n: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}B/s"


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3g}s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g}ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g}us"
    return f"{s * 1e9:.3g}ns"


def fmt_count(n: float) -> str:
    """Parameter counts and token rates: 8.03B, 551k."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 plan``, ``3 plans``, ``1,024 devices``: a count with its noun in the number it takes (English:
    singular for exactly one). ``plural`` for nouns that do not take an ``s`` (``1 batch`` / ``2 batches``)."""
    word = noun if n == 1 else (plural or noun + "s")
    return f"{n:,} {word}"
