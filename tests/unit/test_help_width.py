"""`--help` in a narrow terminal: every option name whole, every command's description whole.

Each command and subcommand's help runs through the real entry point (``autotune.cli.main``, in this
process) with COLUMNS set, and is checked against what the click command tree declares: a help
layout may wrap an option's help text, never cut its name ("--emulate-slowd…" at 80 columns was
issue 39, item 8), and a group's list may wrap a command's description, never cut it to "...".
"""

from __future__ import annotations

import re

import pytest
import typer
from helpers.cli import cli

from autotune.cli import build_app

ROOT = typer.main.get_command(build_app())


def _walk(cmd, path=()):
    yield path, cmd
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(ROOT))
WIDTHS = (80, 60)


def _whole(name: str) -> str:
    # the name as a token of its own: not a prefix of a longer name, not followed by an ellipsis
    return rf"(?<![\w-]){re.escape(name)}(?![\w…-])"


def _option_names(cmd) -> list[list[str]]:
    return [[o for o in (*p.opts, *p.secondary_opts)] for p in cmd.params if p.opts and p.opts[0].startswith("-")]


def _flat(text: str) -> str:
    # the prose of a help page on one line (a table's borders left out): a word wrapped after its
    # hyphen joins again
    text = text.replace("│", " ")
    return re.sub(r"\s+", " ", re.sub(r"-\n\s*", "-", text))


def _help(capsys, monkeypatch, path, width) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = cli(capsys, *path, "--help")
    assert code == 0, err
    return out


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "autotune" for p, _ in COMMANDS])
def test_help_shows_every_option_name_whole(capsys, monkeypatch, path, cmd, width):
    out = _help(capsys, monkeypatch, path, width)
    # an option's row: a line that starts (after a table's border and the required mark) with one
    # of its names and carries all of them whole; a mention in another option's help is no row
    rows = [line.lstrip(" │*") for line in out.splitlines()]
    for names in _option_names(cmd):
        listed = [r for r in rows if any(re.match(_whole(n), r) for n in names)
                  and all(re.search(_whole(n), r) for n in names)]
        assert listed, f"`autotune {' '.join(path)} --help` at {width} columns cuts or splits {names}:\n{out}"
    assert max(map(len, out.splitlines())) <= width, f"a line wider than {width} columns:\n{out}"


@pytest.mark.parametrize("path,cmd", [(p, c) for p, c in COMMANDS if getattr(c, "commands", None)],
                         ids=[" ".join(p) or "autotune" for p, c in COMMANDS if getattr(c, "commands", None)])
def test_group_help_lists_each_command_with_its_whole_description(capsys, monkeypatch, path, cmd):
    out = _flat(_help(capsys, monkeypatch, path, 80))
    for name, sub in cmd.commands.items():
        first_paragraph = re.sub(r"\s+", " ", (sub.help or "").split("\n\n")[0]).strip()
        assert f"{name} {first_paragraph}" in out, f"`{name}`'s description is cut or changed:\n{out}"


def test_bare_autotune_prints_the_help_on_stdout(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = cli(capsys)
    assert code == 0 and err == ""
    assert out == _help(capsys, monkeypatch, (), 80)
