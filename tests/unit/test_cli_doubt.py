"""What a ``leadgate`` command says when the server could not say whether its write's
COMMIT landed (:mod:`leadgate.cli.doubt`): every command that writes has its own way to
tell, each naming only its own arguments and the ids it made."""

from __future__ import annotations

import argparse
import string

import pytest

from leadgate.cli.commands import COMMANDS
from leadgate.cli.doubt import DEMO_KEY_LOST, LOOKS, Look
from leadgate.cli.parser import build_parser

#: ``demo``, whose look depends on what it made (:data:`DEMO_KEY_LOST`).
NOT_LOOKED_UP = {("demo", None)}


def _writes() -> list[tuple[str, str | None]]:
    return [
        command
        for command in COMMANDS
        if command[1] not in ("list", "show", "links") and command not in NOT_LOOKED_UP
    ]


def _subparser(command: tuple[str, str | None]) -> argparse.ArgumentParser:
    parser = build_parser("")
    for name in command:
        if name is None:
            break
        choices = next(
            action.choices
            for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
        )
        parser = choices[name]
    return parser


def _fields(look: Look) -> set[str]:
    texts = (look.show, look.made, look.then, look.again)
    return {field for text in texts for _, field, _, _ in string.Formatter().parse(text) if field}


@pytest.mark.parametrize("command", _writes(), ids=" ".join)
def test_every_command_that_writes_says_how_to_tell_whether_it_was_made(
    command: tuple[str, str | None],
) -> None:
    """A command missing here said only "look (list or show)"."""
    assert command in LOOKS
    look = LOOKS[command]
    assert bool(look.again) != bool(look.show and look.made)


@pytest.mark.parametrize(
    "command", [*_writes(), ("demo", None)], ids=lambda c: " ".join(filter(None, c))
)
def test_what_a_command_says_names_only_its_own_arguments(command: tuple[str, str | None]) -> None:
    look = DEMO_KEY_LOST if command == ("demo", None) else LOOKS[command]
    dests = {action.dest for action in _subparser(command)._actions}
    assert {f for f in _fields(look) if not f.startswith("new_")} <= dests
