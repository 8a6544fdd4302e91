"""Reading typed fields out of parsed YAML/JSON mappings with errors that name the field.

The loaders of model files, cluster files and plans all use these, so every bad value is reported
the same way: ``<file>: <field>: <what was wrong>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import InputError

_MISSING = object()


def read_mapping(path: str | Path, what: str) -> dict[str, Any]:
    """Parse a YAML or JSON file into a mapping; every failure is an InputError naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} file not found", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {what} file: {exc}", source=str(path)) from None
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"does not parse as {'JSON' if p.suffix.lower() == '.json' else 'YAML'}: {first}",
                         source=str(path)) from None
    if not isinstance(data, dict):
        raise InputError(f"a {what} file must hold a mapping of keys, got {type(data).__name__}",
                         source=str(path))
    return data


def get(d: dict[str, Any], key: str, field: str, default: Any = _MISSING) -> Any:
    if key not in d or d[key] is None:
        if default is _MISSING:
            raise InputError("missing required field", field=field)
        return default
    return d[key]


def get_int(d: dict[str, Any], key: str, field: str, default: Any = _MISSING, minimum: int = 1) -> int:
    v = get(d, key, field, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise InputError(f"expected an integer, got {v!r}", field=field)
    v = int(v)
    if v < minimum:
        raise InputError(f"must be at least {minimum}, got {v}", field=field)
    return v


def get_str(d: dict[str, Any], key: str, field: str, default: Any = _MISSING,
            choices: tuple[str, ...] | None = None) -> str:
    v = get(d, key, field, default)
    if not isinstance(v, str) or not v.strip():
        raise InputError(f"expected a non-empty string, got {v!r}", field=field)
    if choices is not None and v not in choices:
        raise InputError(f"must be one of {', '.join(choices)}, got {v!r}", field=field)
    return v


def get_bool(d: dict[str, Any], key: str, field: str, default: Any = _MISSING) -> bool:
    v = get(d, key, field, default)
    if not isinstance(v, bool):
        raise InputError(f"expected true or false, got {v!r}", field=field)
    return v


def reject_unknown(d: dict[str, Any], known: set[str], where: str | None) -> None:
    """Unknown keys are typos more often than extensions: name them."""
    from autotune.errors import suggest

    for k in d:
        if k not in known:
            raise InputError(f"unknown key {k!r}" + suggest(str(k), known), field=where)
