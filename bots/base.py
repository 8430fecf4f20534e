"""The one small interface between a channel adapter and the core.

An adapter module (``bots/slack.py`` ...) has two thin halves:

* inbound: verify the platform's authenticity mechanism, parse the request into a
  neutral :class:`engine.types.Trigger`, acknowledge fast, and hand the trigger to
  :meth:`Core.submit` (in the background when the platform wants a quick ack);
* outbound: a :class:`outbox.channel.Channel` whose ``send`` maps SDK errors onto the
  outcome classes. Replies of plain turns and approved output both go through the outbox,
  so the inbound half never posts a turn's text itself.

Nothing outside ``bots/`` imports a channel SDK.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from engine.types import Outcome, Trigger
from outbox.channel import Channel


@dataclass(frozen=True)
class RouteMatch:
    """Which organization and agent answer an inbound channel trigger."""

    route_id: str
    org_id: str
    agent_id: str
    silent: bool


class Core(Protocol):
    """What an inbound adapter may ask of the core."""

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """Most specific route of ``channel`` whose match keys all equal ``attrs``.

        Match keys: slack ``team``, ``channel``; discord ``guild``, ``channel``; teams
        ``tenant``, ``conversation``; email ``address`` (recipient) and ``sender``
        (an allowed sender address or ``*@domain``). ``None``: nobody answers; the
        adapter runs no turn.
        """
        ...

    async def submit(self, trigger: Trigger) -> Outcome:
        """Run the turn on the shared wait path; a plain reply is queued for posting."""
        ...

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Run ``coro`` in the background, tracked, logged on failure, awaited on shutdown."""
        ...


class Adapter(Protocol):
    """One channel: its inbound HTTP routes/listeners and its outbound sender.

    Each adapter module exposes ``create(settings: engine.config.Settings, core: Core)
    -> Adapter | None`` returning ``None`` when the channel's secret is unset (channel off).
    """

    #: the outbound half, registered with the relay under ``channel.name``
    channel: Channel

    def mount(self, app: web.Application) -> None:
        """Add inbound routes and lifecycle hooks (``app.cleanup_ctx``) to ``app``."""
        ...
