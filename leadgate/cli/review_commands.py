"""Review-card commands: ``leadgate notify add|list|remove|sla`` and
``leadgate user link|unlink|links`` (one function each; their parser is
:mod:`leadgate.cli.review_parser`).

Kept apart from :mod:`leadgate.cli.commands` so that the command table there only gains
one ``update`` line.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

from leadgate.core.config import Settings
from leadgate.core.errors import ValidationError
from leadgate.domain.links import LinkView, ListedLinkView, UnlinkedView
from leadgate.operations.admin import Admin
from leadgate.operations.review_setup import (
    DestinationsView,
    RemovedDestinationView,
    ReviewSetup,
    SetSlaView,
)
from leadgate.review.destinations import ReviewDestinationView

Command = Callable[[Admin, argparse.Namespace, Settings], Awaitable[Any]]


def _setup(admin: Admin, settings: Settings) -> ReviewSetup:
    return ReviewSetup(admin.db, admin.clock, admin.ids, settings.review)


def _platform(args: argparse.Namespace) -> tuple[str, str]:
    for platform in ("slack", "teams", "discord"):
        value = getattr(args, platform, None)
        if value:
            return platform, str(value)
    raise ValidationError("give --slack, --teams or --discord", rule="link.platform")


class AddedDestinationView(ReviewDestinationView):
    """``notify add``'s output: the destination, and whether this configuration has
    the channel's credentials (cards to it wait until it has)."""

    channelConfigured: bool


async def notify_add(
    admin: Admin, args: argparse.Namespace, settings: Settings
) -> AddedDestinationView:
    """``leadgate notify add --org ORG --channel C --to TARGET [--agent NAME] [--escalation]``."""
    out = await _setup(admin, settings).add_destination(
        args.org, args.channel, args.target, agent=args.agent, escalation=args.escalation
    )
    return {**out, "channelConfigured": _configured(settings, args.channel)}


async def notify_list(
    admin: Admin, args: argparse.Namespace, settings: Settings
) -> DestinationsView:
    """``leadgate notify list --org ORG [--agent NAME]``."""
    return await _setup(admin, settings).list_destinations(args.org, args.agent)


async def notify_remove(
    admin: Admin, args: argparse.Namespace, settings: Settings
) -> RemovedDestinationView:
    """``leadgate notify remove --org ORG DESTINATION_ID``."""
    return await _setup(admin, settings).remove_destination(args.org, args.destination)


async def notify_sla(admin: Admin, args: argparse.Namespace, settings: Settings) -> SetSlaView:
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


async def user_link(admin: Admin, args: argparse.Namespace, settings: Settings) -> LinkView:
    """``leadgate user link --org ORG --email E --slack T:U | --teams OID | --discord ID``."""
    platform, identity = _platform(args)
    return await _setup(admin, settings).link(args.org, args.email, platform, identity)


async def user_unlink(admin: Admin, args: argparse.Namespace, settings: Settings) -> UnlinkedView:
    """``leadgate user unlink`` (same arguments as ``user link``)."""
    platform, identity = _platform(args)
    return await _setup(admin, settings).unlink(args.org, args.email, platform, identity)


async def user_links(
    admin: Admin, args: argparse.Namespace, settings: Settings
) -> list[ListedLinkView]:
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
