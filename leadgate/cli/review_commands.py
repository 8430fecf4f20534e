"""Review-card commands: ``leadgate notify add|list|remove|sla`` and
``leadgate user link|unlink|links`` (their parser and one function each).

Kept apart from :mod:`leadgate.cli.commands` and :mod:`leadgate.cli.parser` so that the
command table there only gains one ``update`` line.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from leadgate.core.config import Settings
from leadgate.core.errors import ValidationError
from leadgate.operations.admin import Admin
from leadgate.operations.review_setup import ReviewSetup

Command = Callable[[Admin, argparse.Namespace, Settings], Awaitable[Any]]
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


def _setup(admin: Admin, settings: Settings) -> ReviewSetup:
    return ReviewSetup(admin.db, admin.clock, admin.ids, settings.review)


def _platform(args: argparse.Namespace) -> tuple[str, str]:
    for platform in ("slack", "teams", "discord"):
        value = getattr(args, platform, None)
        if value:
            return platform, str(value)
    raise ValidationError("give --slack, --teams or --discord", rule="link.platform")


async def notify_add(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate notify add --org ORG --channel C --to TARGET [--agent NAME] [--escalation]``."""
    out = await _setup(admin, settings).add_destination(
        args.org, args.channel, args.target, agent=args.agent, escalation=args.escalation
    )
    out["channelConfigured"] = _configured(settings, args.channel)
    return out


async def notify_list(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate notify list --org ORG [--agent NAME]``."""
    return await _setup(admin, settings).list_destinations(args.org, args.agent)


async def notify_remove(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate notify remove --org ORG DESTINATION_ID``."""
    return await _setup(admin, settings).remove_destination(args.org, args.destination)


async def notify_sla(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate notify sla --org ORG [--agent NAME] [--remind-after D] ...``."""
    return await _setup(admin, settings).set_sla(
        args.org,
        args.agent,
        {
            "remind_after": args.remind_after,
            "remind_every": args.remind_every,
            "escalate_after": args.escalate_after,
            "expire_after": args.expire_after,
        },
    )


async def user_link(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate user link --org ORG --email E --slack T:U | --teams OID | --discord ID``."""
    platform, identity = _platform(args)
    return await _setup(admin, settings).link(args.org, args.email, platform, identity)


async def user_unlink(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate user unlink`` (same arguments as ``user link``)."""
    platform, identity = _platform(args)
    return await _setup(admin, settings).unlink(args.org, args.email, platform, identity)


async def user_links(admin: Admin, args: argparse.Namespace, settings: Settings) -> Any:
    """``leadgate user links --org ORG``."""
    return await _setup(admin, settings).links(args.org)


def _configured(settings: Settings, channel: str) -> bool:
    if channel == "slack":
        return bool(settings.slack.signing_secret and settings.slack.bot_token)
    if channel == "discord":
        return bool(settings.discord.bot_token)
    if channel == "teams":
        return bool(settings.teams.enabled or settings.teams.app_id)
    return bool(settings.email.smtp_host and settings.email.from_address)


REVIEW_COMMANDS: dict[tuple[str, str | None], Command] = {
    ("notify", "add"): notify_add,
    ("notify", "list"): notify_list,
    ("notify", "remove"): notify_remove,
    ("notify", "sla"): notify_sla,
    ("user", "link"): user_link,
    ("user", "unlink"): user_unlink,
    ("user", "links"): user_links,
}
