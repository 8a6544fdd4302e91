"""Where a search space comes from (``autotune search --space``), as Optuna takes a sampler: a name
of the built-in ``search_spaces/`` package, a Python file, or an installed entry point.

* ``--space default``: the module ``search_spaces.default``;
* ``--space path/to/my_space.py`` (a value ending in ``.py`` or naming a directory): that file,
  loaded as a module;
* ``--space NAME`` where an installed distribution declares ``NAME`` in the entry-point group
  ``autotune.spaces`` (``[project.entry-points."autotune.spaces"] NAME = "pkg.module"``, or
  ``"pkg.module:space"`` for the function itself).

Whatever it comes from, a space module defines ``space(ctx) -> Space`` (``search_spaces/base.py``;
docs/spaces.md has a small example). The search's worker processes load it again from the same
string, so a file or entry point works with ``--workers`` too. Anything that does not load is one
InputError naming ``--space`` (exit 2).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from autotune.errors import InputError, suggest

ENTRY_POINT_GROUP = "autotune.spaces"
FIELD = "--space"


def builtin_names() -> list[str]:
    """The modules of ``search_spaces/`` (less ``base`` and private helpers)."""
    import pkgutil

    import search_spaces

    return sorted({m.name for m in pkgutil.iter_modules(list(search_spaces.__path__))
                   if not m.name.startswith("_") and m.name != "base"})


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def space_names() -> list[str]:
    """Every name ``--space`` takes: the built-in spaces and the installed entry points."""
    return sorted(set(builtin_names()) | set(_entry_points()))


def is_path(value: str) -> bool:
    return value.endswith(".py") or os.sep in value or (os.altsep is not None and os.altsep in value)


def load_space(name: str) -> Any:
    """The space module ``name`` says (anything with a callable ``space(ctx)``): a Python file, a
    built-in space, or an entry point of ``autotune.spaces``, in that order."""
    if is_path(name):
        return _checked(_load_file(Path(name)), name)
    if name in builtin_names():
        # works whether search_spaces is installed as a regular or (an old editable install) a namespace package
        return importlib.import_module(f"search_spaces.{name}")
    ep = _entry_points().get(name)
    if ep is None:
        raise InputError(f"unknown search space {name!r}" + suggest(name, space_names())
                         + " (or give a Python file: --space path/to/space.py)", field=FIELD)
    try:
        obj = ep.load()
    except Exception as e:  # its own import failed: say which and why, in one line
        raise InputError(f"entry point {name!r} ({ep.value}) of {ENTRY_POINT_GROUP} does not load: "
                         f"{type(e).__name__}: {e}", field=FIELD) from None
    if callable(obj) and not hasattr(obj, "space"):
        obj = SimpleNamespace(space=obj, NAME=name)  # the entry point names the function itself
    return _checked(obj, f"entry point {name!r} ({ep.value})")


def _load_file(path: Path) -> Any:
    """Execute the file as a module registered in ``sys.modules`` under a name of its resolved path
    (its dataclasses and pickles need one); loaded once per process."""
    if not path.is_file():
        raise InputError("no such search space file" if not path.exists() else "not a file",
                         source=str(path), field=FIELD)
    resolved = path.resolve()
    mod_name = f"autotune_space_{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:10]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise InputError("cannot be loaded as a Python module", source=str(path), field=FIELD)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the file's own error, in one line (SyntaxError says where)
        del sys.modules[mod_name]
        raise InputError(f"does not load as a search space: {type(e).__name__}: {e}", source=str(path),
                         field=FIELD) from None
    return module


SPACE_METHODS = ("distributions", "build", "baselines")
"""What the search calls on every space (``search_spaces/base.Space``); checked before a study is written."""


def build_space(module: Any, ctx: Any, name: str) -> Any:
    """``module.space(ctx)``, checked: a space() that raises, or returns something without the
    methods the search calls, is one InputError naming ``--space`` (exit 2) before anything is stored."""
    try:
        sp = module.space(ctx)
    except InputError:
        raise  # a space that refuses the workload names the field it refuses
    except Exception as e:  # the space's own bug, in one line
        raise InputError(f"{name}: space(ctx) raised {type(e).__name__}: {e}", field=FIELD) from None
    missing = [m for m in SPACE_METHODS if not callable(getattr(sp, m, None))]
    if missing:
        raise InputError(f"{name}: space(ctx) returned {type(sp).__name__} {sp!r:.60}, not a search space (it has no "
                         f"{', '.join(missing)}; see docs/spaces.md)", field=FIELD)
    return sp


def _checked(obj: Any, what: str) -> Any:
    if not callable(getattr(obj, "space", None)):
        raise InputError(f"{what} defines no space(ctx) function (see docs/spaces.md)", field=FIELD)
    return obj
