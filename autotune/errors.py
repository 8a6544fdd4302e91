"""The two kinds of failure the CLI distinguishes (exit 2 and exit 1).

Every error a user can cause is an ``InputError``: it carries where it came from (a file, a
command-line option) and the field, so the CLI prints one line such as
``cluster.yaml: nodes[0].device: unknown device type 'H10'; did you mean H100-SXM, H100-PCIe?``.
"""

from __future__ import annotations

import difflib
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


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """'; did you mean X, Y?' for the nearest names, or '; known: ...' when none is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    if close:
        return "; did you mean " + ", ".join(lowered[c] for c in close) + "?"
    return "; known: " + ", ".join(sorted(choices))
