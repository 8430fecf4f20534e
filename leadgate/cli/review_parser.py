"""The parser of the review-card commands (``leadgate notify ...``, ``leadgate user
link|unlink|links``; their functions are :mod:`leadgate.cli.review_commands`).

Apart from those functions so that building the parser (``--help``, ``--version``, a
usage error) imports no operations code.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

Maker = Callable[[str, str], argparse.ArgumentParser]

TARGET_HELP = (
    "slack: CHANNEL_ID or TEAM:CHANNEL_ID; discord: CHANNEL_ID or GUILD:CHANNEL_ID; "
    "email: an address; teams: a conversation id the bot has seen (19:...), or a "
    "conversation reference as JSON"
)
DURATION_HELP = "a duration (30m, 2h, 1d, 1h30m), off, or inherit"


def add_notify_parser(sub: Any, group: Callable[[Any, str, str], Maker]) -> None:
    """``leadgate notify ...`` (``group`` is :func:`leadgate.cli.parser._group`)."""
    notify = group(sub, "notify", "review cards: where they go and when they remind")
    na = notify("add", "send review cards of the organization (or one agent) to a channel")
    na.add_argument("--org", required=True)
    na.add_argument("--channel", required=True, choices=["slack", "teams", "discord", "email"])
    na.add_argument("--to", required=True, dest="target", help=TARGET_HELP)
    na.add_argument("--agent", help="only this agent's items (replaces the organization's)")
    na.add_argument(
        "--escalation", action="store_true", help="an escalation destination (escalate_after)"
    )
    nl = notify("list", "list destinations and the effective reminder / expiry times")
    nl.add_argument("--org", required=True)
    nl.add_argument("--agent")
    nr = notify("remove", "remove a destination")
    nr.add_argument("--org", required=True)
    nr.add_argument("destination")
    ns = notify("sla", "set reminder, escalation and expiry times")
    ns.add_argument("--org", required=True)
    ns.add_argument("--agent", help="only this agent's items")
    for flag in ("--remind-after", "--remind-every", "--escalate-after", "--expire-after"):
        ns.add_argument(flag, help=DURATION_HELP)


def add_user_link_parsers(user: Maker) -> None:
    """``leadgate user link|unlink|links`` (``user`` makes subcommands of ``user``)."""
    for name, text in (
        ("link", "let a chat user decide review cards as this console user"),
        ("unlink", "remove such a link"),
    ):
        p = user(name, text)
        p.add_argument("--org", required=True)
        p.add_argument("--email", required=True)
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--slack", metavar="TEAM:USER")
        which.add_argument("--teams", metavar="AAD_OBJECT_ID")
        which.add_argument("--discord", metavar="USER_ID")
    user("links", "list the organization's chat links").add_argument("--org", required=True)
