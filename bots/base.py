"""The one small interface between a channel adapter and the core.

An adapter module (``bots/slack.py`` ...) has two thin halves:

* inbound: verify the platform's authenticity mechanism, parse the request into a
  neutral :class:`leadgate.core.types.Inbound`, acknowledge fast, and hand it to
  :meth:`Core.take_inbound` (the one "route -> trigger -> submit" step, shared by every
  adapter; in the background when the platform wants a quick ack);
* outbound: a :class:`outbox.channel.Channel` whose ``send`` maps SDK errors onto the
  outcome classes. Replies of plain turns and approved output both go through the outbox,
  so the inbound half never posts a turn's text itself.

Nothing outside ``bots/`` imports a channel SDK.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from aiohttp import web

from leadgate.core.types import Inbound, Routed, RouteMatch
from outbox.channel import Channel


class Core(Protocol):
    """What an inbound adapter may ask of the core
    (:class:`leadgate.operations.messages.Messages`)."""

    async def take_inbound(self, inbound: Inbound) -> Routed | None:
        """Route ``inbound`` and run its turn on the shared wait path; ``None`` when no
        route answers (no turn ran). A plain reply is queued for posting."""
        ...

    async def resolve_route(self, channel: str, attrs: Mapping[str, str]) -> RouteMatch | None:
        """Most specific route of ``channel`` whose match keys all equal ``attrs``.

        Match keys: slack ``team``, ``channel``; discord ``guild``, ``channel``; teams
        ``tenant``, ``conversation``; email ``address`` (recipient) and ``sender``
        (an allowed sender address or ``*@domain``). ``None``: nobody answers; the
        adapter runs no turn (email refuses the recipient at RCPT time).
        """
        ...

    def spawn(self, coro: Awaitable[object], *, name: str) -> None:
        """Run ``coro`` in the background, tracked, logged on failure, awaited on shutdown."""
        ...


class Adapter(Protocol):
    """One channel: its inbound HTTP routes/listeners and its outbound sender.

    Each adapter module exposes ``create(settings: leadgate.core.config.Settings, core:
    Core) -> Adapter | None`` returning ``None`` when the channel's secret is unset
    (channel off). The composition root (:mod:`leadgate.app`) mounts the routes, runs
    :meth:`lifespan` while the HTTP surfaces serve, and closes :attr:`channel` at the end.
    """

    #: the outbound half, registered with the relay under ``channel.name``
    channel: Channel

    def mount(self, app: web.Application) -> None:
        """Add the inbound HTTP routes (if any) to ``app``."""
        ...

    def lifespan(self) -> AbstractAsyncContextManager[None]:
        """Run the inbound listeners that are not HTTP routes (a gateway, SMTP) for the
        duration of the block."""
        ...
