"""The two kinds of failure the CLI distinguishes (exit 2 and exit 1).

Every error a user can cause is an ``InputError``: it carries where it came from (a file, a
command-line option) and the field, so the CLI prints one line such as
``cluster.yaml: nodes[0].device: unknown device type 'H10'; did you mean H100-SXM, H100-PCIe?``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class AutotuneError(Exception):
    """Base class; ``exit_code`` is what the CLI exits with."""

    exit_code = 1
    kind = "error"


class InputError(AutotuneError):
    """Bad input: a file, field or option the user gave is wrong. Exit 2."""

    exit_code = 2
    kind = "input"

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.message = message
        self.source = source
        self.field = field
        super().__init__(self.render())

    def render(self) -> str:
        prefix = ""
        if self.source:
            prefix += f"{self.source}: "
        if self.field:
            prefix += f"{self.field}: "
        return prefix + self.message

    def within(self, source: str | None = None, field_prefix: str | None = None) -> InputError:
        """The same error located in ``source`` and under ``field_prefix`` (for nested loaders)."""
        field = self.field
        if field_prefix:
            field = f"{field_prefix}.{field}" if field else field_prefix
        return InputError(self.message, source=source or self.source, field=field)


class WorkError(AutotuneError):
    """The input was fine but the work failed (a rank died, a study had no trials). Exit 1."""

    exit_code = 1
    kind = "work"


def _family(name: str) -> str:
    """The leading letters and digits of a name: ``H100-SXM`` -> ``h100``, ``A100-40GB`` -> ``a100``."""
    m = re.match(r"[a-z]*[0-9]*", name.lower())
    return m.group(0) if m else ""


def nearest(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Choices ranked for a mistyped ``name``: every choice that starts with it (``H100`` ->
    ``H100-SXM, H100-PCIe, H100-NVL``, all of them, since a prefix is a family the user named), then
    the same family (``A100-80`` -> the A100s); only when neither exists, the closest spellings
    (difflib)."""
    choices = list(dict.fromkeys(choices))
    low = name.lower()
    prefix = [c for c in choices if c.lower().startswith(low) and c.lower() != low]
    fam = _family(name)
    family = [c for c in choices if fam and _family(c) == fam and c not in prefix]
    if prefix or family:  # the user named a family: show it, not look-alikes of other families
        return (prefix + family)[:max(n, len(prefix))]
    lowered = {c.lower(): c for c in choices}
    return [lowered[c] for c in difflib.get_close_matches(low, list(lowered), n=n, cutoff=0.5)]


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """'; did you mean X, Y?' for the nearest names (``nearest``), or '; known: ...' when none is close."""
    choices = list(choices)
    close = nearest(name, choices, n)
    if close:
        return "; did you mean " + ", ".join(close) + "?"
    return "; known: " + ", ".join(sorted(choices))
