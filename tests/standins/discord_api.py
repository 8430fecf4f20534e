"""A Discord stand-in on 127.0.0.1: REST API v10 and the gateway websocket.

Use in-process::

    async with DiscordApiStandin(token="bot-token") as dc:
        discord.http.Route.BASE = dc.api_url            # or [discord] api_url
        DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(dc.gateway_url)   # or gateway_url
        dc.queue("ratelimited:60", "ok")                # next write requests, in order
        dc.set_channel_mode("123", "forbidden")         # sticky per channel id / token
        await dc.wait_gateway_ready()
        await dc.dispatch_message_create(channel_id="123", guild_id="9", content="hi")
        dc.history("123")   # the channel's messages (GET /channels/{id}/messages reads them)
        dc.fail_reads("123", "500")   # the next reads of a channel's messages, in order
        await dc.invalidate_sessions()  # INVALID_SESSION: the client identifies again
        await dc.dispatch_guild_create("9")  # GUILD_CREATE with its threads: cached
        dc.posts      # what was posted/edited/deleted, see below
        dc.requests   # every write request, with the mode that answered it
        dc.on_post = hook   # awaited with each channel message's record before it is answered
        dc.on_read = hook   # awaited with each read of a channel's messages (dc.reads)

or as a subprocess::

    python -m tests.standins.discord_api --port 0 [--latency-ms N] [--token T]
    # prints "LISTENING <port>"; api_url http://127.0.0.1:<port>/api/v10,
    # gateway ws://127.0.0.1:<port>/gateway

HTTP control endpoints (JSON): ``GET /_standin/posts``, ``GET /_standin/requests``,
``POST /_standin/modes`` (``{"queue": [...]}`` and/or ``{"channel": KEY, "mode": M|null}``),
``POST /_standin/reset``, ``GET /_standin/gateway`` (``{"connected", "ready",
"identifies"}``), ``POST /_standin/gateway/message_create`` (body: the keyword arguments
of :meth:`DiscordApiStandin.dispatch_message_create`; answers the message payload).

Records in ``posts`` (one dict each, ``op`` says what happened):
``create_message`` (``channel_id, content, nonce, enforce_nonce, message_reference, id``),
``followup`` (``application_id, token, content, id``), ``edit_original`` (same keys),
``delete_original`` (``application_id, token``), ``edit_message`` (``PATCH
/channels/{id}/messages/{id}``: ``channel_id, message_id, content, components``; how a
review card is updated). ``create_message`` records carry the message's ``components``
too. A repeated nonce (``enforce_nonce``)
inside ``nonce_window_s`` returns the first message and adds no record.

Every message of a channel (dispatched on the gateway, whether or not a session was
connected, or posted by the bot) is kept in its history, read as Discord serves it:
``GET /channels/{id}/messages`` with ``limit`` (1..100, default 50) and one of
``after``/``before``, answered newest first (with ``after``: the ``limit`` oldest messages
after it, newest first, which is what discord.py's ``history(after=...)`` pages on;
without the ``nonce`` a bot's message was posted with, which Discord does not keep);
``reads`` records each such read. ``GET /channels/{id}`` answers a channel some message
was dispatched in (a guild text channel, or a DM without a guild) or a thread
:meth:`DiscordApiStandin.start_thread` started, else 404 ``Unknown Channel``; ``GET
/guilds/{id}/threads/active`` answers the guild's threads not archived (``thread_reads``
records the guild of each such read; ``fail_reads("guild:" + guild_id, *modes)`` answers
the next ones in those modes); ``GET /channels/{id}/threads/archived/public`` (``before``
an ISO8601 time, ``limit`` 2..100, default 50) answers the channel's threads
:meth:`DiscordApiStandin.archive_thread` archived, the latest archived first, with
``has_more`` (``archived_reads`` records the channel of each such read;
``fail_reads("archived:" + channel_id, *modes)``; asked of a thread: 400, code 50024);
``GET /channels/{id}/users/@me/threads/archived/private`` answers the same for the
private threads (``start_thread(..., private=True)``, all joined by the bot; read in
``private_reads``; ``fail_reads("private:" + channel_id, *modes)``), the latest
archived first (Discord orders them by id: the same here for threads archived in the
order they were made).

Modes answer write requests only (channel messages, webhook POST/PATCH/DELETE); login
(``GET /users/@me``, ``GET /oauth2/applications/@me``) always answers. Per-key modes use
the channel id for channel messages and the interaction token for webhooks.

======================  ==================================================================
``ok``                  do it
``ratelimited[:S]``     429 with ``Via``, ``Retry-After: S`` and ``{"retry_after": S}``
                        (default 1); discord.py sleeps and retries when S <= 30
``ratelimited_novia``   same without ``Via`` (what Cloudflare bans look like)
``ratelimited_proxy``   429 with ``Via`` and ``Retry-After: 5`` but a JSON body without
                        ``retry_after`` (a proxy on the way that limits on its own)
``500`` (any 5xx)       that status, JSON body
``forbidden``           403 ``{"code": 50001, "message": "Missing Access"}``
``invalid_form_echo``   400 ``{"code": 50035, "message": "Invalid Form Body", ...}``, its
                        field error quoting the content
``not_found``           404 ``{"code": 10003, "message": "Unknown Channel"}``
``unauthorized``        401 ``{"code": 0, "message": "401: Unauthorized"}``
``expired``             401 ``{"code": 50027, "message": "Invalid Webhook Token"}``: an
                        interaction token past its 15 minutes (set it per token)
``no_route``            404 ``{"code": 0, "message": "404: Not Found"}``: Discord's answer
                        for a route it does not have
``not_discord``         404 with an HTML page: a web server that is not Discord's API
``portal``              200 with an HTML page, nothing done: a captive portal's or a
                        proxy's answer, not Discord's
``hang``                read the request, never answer (until the stand-in stops)
``made_502``            do it, then answer 502 with an HTML page (Discord's edge timing
                        out on a request its backend carried out)
``reset``               read the request, then reset the TCP connection (RST)
======================  ==================================================================
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Self

from aiohttp import WSMsgType, web
from nacl.signing import SigningKey

from tests.standins.common import StandinBase, portal_page, serve_main

__all__ = ["DiscordApiStandin", "config_section", "interaction_headers"]

# Discord's gateway opcodes.
_DISPATCH, _HEARTBEAT, _IDENTIFY, _RESUME, _HELLO, _HEARTBEAT_ACK = 0, 1, 2, 6, 10, 11
_INVALID_SESSION = 9
_EPOCH_MS = 1_420_070_400_000


def interaction_headers(
    signing_key: SigningKey, body: bytes, *, timestamp: str | None = None
) -> dict[str, str]:
    """Headers Discord sends with an interaction whose raw body is ``body``."""
    ts = timestamp or str(int(time.time()))
    signature = signing_key.sign(ts.encode() + body).signature.hex()
    return {
        "Content-Type": "application/json",
        "X-Signature-Ed25519": signature,
        "X-Signature-Timestamp": ts,
    }


def config_section(standin: DiscordApiStandin, key: SigningKey | None = None) -> dict[str, str]:
    """The service's ``[discord]`` section pointing its REST calls and gateway at
    ``standin`` with the stand-in's bot token; with ``key``, interactions are verified
    with its public half too."""
    section = {
        "bot_token": standin.token,
        "api_url": standin.api_url,
        "gateway_url": standin.gateway_url,
    }
    if key is not None:
        section = {"public_key": key.verify_key.encode().hex(), **section}
    return section


def _json(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    # Exactly "application/json" (no charset): discord.py reads anything else as text.
    response = web.Response(status=status, body=json.dumps(data).encode(), headers=headers)
    response.headers["Content-Type"] = "application/json"
    return response


def _iso(ms: int) -> str:
    """Epoch milliseconds as Discord writes a time."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


def _now_iso() -> str:
    return datetime.now(UTC).isoformat()


class DiscordApiStandin(StandinBase):
    """Discord REST v10 + gateway with scriptable failures and nonce de-duplication."""

    def __init__(
        self,
        *,
        token: str = "standin-bot-token",
        application_id: str = "1100000000000000001",
        bot_user_id: str = "1100000000000000002",
        latency_ms: int = 0,
        nonce_window_s: float = 300.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.token = token
        self.application_id = application_id
        self.bot_user_id = bot_user_id
        self.nonce_window_s = nonce_window_s
        self.identifies: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._nonces: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        self._originals: dict[str, dict[str, Any]] = {}
        self._deleted_originals: set[str] = set()
        self._sockets: set[web.WebSocketResponse] = set()
        self._ready_sockets: set[web.WebSocketResponse] = set()
        self._seq = itertools.count(1)
        self._ready = asyncio.Event()
        #: channel id -> its messages, oldest first; channel id -> its guild (None: a DM)
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._guilds: dict[str, str | None] = {}
        #: thread id -> its parent channel (its guild in ``_guilds``)
        self._threads: dict[str, str] = {}
        #: each read of a guild's active threads: its guild id
        self.thread_reads: list[str] = []
        #: thread id -> when it was archived (epoch ms)
        self._archived: dict[str, int] = {}
        #: each read of a channel's archived threads: its channel id
        self.archived_reads: list[str] = []
        #: the private threads (all joined by the bot), and each read of a channel's
        #: joined private archived threads: its channel id
        self._private: set[str] = set()
        self.private_reads: list[str] = []
        #: channel id -> modes for the next reads of its messages
        self._read_modes: dict[str, list[str]] = {}
        #: channel id -> modes for its next ``GET /channels/{id}`` (the table's)
        self._lookup_modes: dict[str, list[str]] = {}
        #: each ``GET /channels/{id}``: its channel id and mode
        self.lookups: list[tuple[str, str]] = []
        #: each read of a channel's messages: ``channel_id, after, before, limit, mode``
        self.reads: list[dict[str, Any]] = []
        #: awaited with each read's record before the history is read for its answer
        self.on_read: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        super().__init__(latency_ms=latency_ms, host=host, port=port)

    # -- control ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget records, modes and nonces."""
        super().reset()
        self._history.clear()
        self._guilds.clear()
        self._threads.clear()
        self.thread_reads.clear()
        self._archived.clear()
        self.archived_reads.clear()
        self._private.clear()
        self.private_reads.clear()
        self._read_modes.clear()
        self.reads.clear()
        self._lookup_modes.clear()
        self.lookups.clear()
        self._nonces.clear()
        self._originals.clear()
        self._deleted_originals.clear()

    @property
    def api_url(self) -> str:
        """``[discord] api_url`` / ``discord.http.Route.BASE``."""
        return f"{self.base_url}/api/v10"

    @property
    def gateway_url(self) -> str:
        """``[discord] gateway_url`` / ``DiscordWebSocket.DEFAULT_GATEWAY``."""
        return f"ws://{self.host}:{self._port}/gateway"

    def new_snowflake(self, at_ms: int | None = None) -> str:
        """A fresh Discord-shaped id (timestamp bits + counter), made now or at ``at_ms``."""
        ms = int(time.time() * 1000) if at_ms is None else at_ms
        return str(((ms - _EPOCH_MS) << 22) | (next(self._ids) & 0x3FFFFF))

    def history(self, channel_id: str) -> list[dict[str, Any]]:
        """The channel's messages, oldest first."""
        return list(self._history.get(channel_id, []))

    def start_thread(
        self, guild_id: str, parent_id: str, *, at_ms: int | None = None, private: bool = False
    ) -> str:
        """A public thread (``private``: a private one the bot joined) started (at
        ``at_ms``) under ``parent_id`` of ``guild_id``, active until the stand-in stops
        (messages are dispatched into it by its id, as into any channel); its id."""
        thread_id = self.new_snowflake(at_ms)
        self._threads[thread_id] = parent_id
        self._guilds[thread_id] = guild_id
        if private:
            self._private.add(thread_id)
        return thread_id

    def archive_thread(self, thread_id: str, *, at_ms: int | None = None) -> None:
        """Archive the thread (at ``at_ms``, else now), as Discord's auto-archive does
        after its inactivity duration: it leaves the active listing."""
        self._archived[thread_id] = int(time.time() * 1000) if at_ms is None else at_ms

    def fail_reads(self, channel_id: str, *modes: str) -> None:
        """Answer the next reads of ``channel_id``'s messages with ``modes``, in order
        (see the table; ``ok`` reads)."""
        self._read_modes.setdefault(channel_id, []).extend(modes)

    def fail_lookups(self, channel_id: str, *modes: str) -> None:
        """Answer the next ``GET /channels/{channel_id}`` with ``modes``, in order (see
        the table; ``ok`` answers)."""
        self._lookup_modes.setdefault(channel_id, []).extend(modes)

    def _keep(self, message: dict[str, Any]) -> None:
        channel_id = str(message["channel_id"])
        self._guilds.setdefault(channel_id, message.get("guild_id"))
        kept = self._history.setdefault(channel_id, [])
        kept.append(message)
        kept.sort(key=lambda m: int(m["id"]))

    # -- lifecycle -------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        """The aiohttp application: REST, gateway and control routes."""
        app = web.Application()
        r = app.router
        api = "/api/v{version:\\d+}"
        r.add_get(f"{api}/users/@me", self._users_me)
        r.add_get(f"{api}/oauth2/applications/@me", self._application_me)
        r.add_get(f"{api}/gateway", self._gateway_info)
        r.add_get(f"{api}/gateway/bot", self._gateway_info)
        r.add_post(f"{api}/channels/{{channel_id}}/messages", self._create_message)
        r.add_get(f"{api}/channels/{{channel_id}}/messages", self._read_messages)
        r.add_get(f"{api}/channels/{{channel_id}}", self._get_channel)
        r.add_get(f"{api}/guilds/{{guild_id}}/threads/active", self._active_threads)
        r.add_get(f"{api}/channels/{{channel_id}}/threads/archived/public", self._archived_threads)
        r.add_get(
            f"{api}/channels/{{channel_id}}/users/@me/threads/archived/private",
            self._archived_threads,
        )
        r.add_patch(f"{api}/channels/{{channel_id}}/messages/{{message_id}}", self._edit_message)
        r.add_post(f"{api}/webhooks/{{app_id}}/{{token}}", self._followup)
        r.add_get(f"{api}/webhooks/{{app_id}}/{{token}}/messages/@original", self._get_original)
        r.add_patch(f"{api}/webhooks/{{app_id}}/{{token}}/messages/@original", self._edit_original)
        r.add_delete(
            f"{api}/webhooks/{{app_id}}/{{token}}/messages/@original", self._delete_original
        )
        r.add_get("/gateway", self._gateway)
        self._add_control_routes(r)
        r.add_get("/_standin/gateway", self._gateway_state)
        r.add_post("/_standin/gateway/message_create", self._http_message_create)
        return app

    async def start(self) -> Self:
        """Listen on ``host:port`` (port 0 picks a free one)."""
        self._ready = asyncio.Event()
        return await super().start()

    async def _close_sessions(self) -> None:
        for ws in list(self._sockets):
            await ws.close()

    # -- objects ---------------------------------------------------------------------------

    def bot_user(self) -> dict[str, Any]:
        """The bot's user object."""
        return {
            "id": self.bot_user_id,
            "username": "leadgate",
            "discriminator": "0",
            "global_name": "leadgate",
            "avatar": None,
            "bot": True,
            "flags": 0,
        }

    def _message(
        self,
        *,
        channel_id: str,
        content: str,
        author: dict[str, Any] | None = None,
        guild_id: str | None = None,
        nonce: str | None = None,
        message_reference: dict[str, Any] | None = None,
        webhook_id: str | None = None,
        message_id: str | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "id": message_id or self.new_snowflake(),
            "channel_id": channel_id,
            "type": 19 if message_reference else 0,
            "content": content,
            "author": author or self.bot_user(),
            "timestamp": _now_iso(),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [],
            "mention_roles": [],
            "attachments": [],
            "embeds": [],
            "pinned": False,
            "flags": 0,
            "components": [],
        }
        if guild_id:
            message["guild_id"] = guild_id
        if nonce is not None:
            message["nonce"] = nonce
        if message_reference:
            message["message_reference"] = message_reference
        if webhook_id:
            message["webhook_id"] = webhook_id
        return message

    # -- helpers ---------------------------------------------------------------------------

    def _bot_authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization", "") == f"Bot {self.token}"

    async def _failure(self, request: web.Request, mode: str) -> web.StreamResponse | None:
        """The response for a failure mode, or None for ``ok`` (and ``made_502``, whose
        502 comes after the request is carried out)."""
        if mode in ("ok", "made_502"):
            return None
        cut = await self._hang_or_reset(request, mode)
        if cut is not None:
            return cut
        if mode == "ratelimited_proxy":
            return _json(
                {"message": "Too Many Requests"},
                status=429,
                headers={"Via": "1.1 proxy", "Retry-After": "5"},
            )
        if mode.startswith("ratelimited"):
            name, _, seconds = mode.partition(":")
            retry_after = float(seconds or "1")
            headers = {
                "Retry-After": f"{retry_after:g}",
                "X-RateLimit-Scope": "user",
            }
            if name != "ratelimited_novia":
                headers["Via"] = "1.1 google"
            return _json(
                {
                    "message": "You are being rate limited.",
                    "retry_after": retry_after,
                    "global": False,
                },
                status=429,
                headers=headers,
            )
        if mode.isdigit():
            return _json({"message": f"{mode}: Server Error", "code": 0}, status=int(mode))
        if mode == "forbidden":
            return _json({"message": "Missing Access", "code": 50001}, status=403)
        if mode == "invalid_form_echo":
            # A 400 whose field error quotes the value it refused (the post's text).
            content = (await request.json()).get("content")
            error = {"code": "BASE_TYPE_BAD", "message": f"Not allowed: {content}"}
            return _json(
                {
                    "message": "Invalid Form Body",
                    "code": 50035,
                    "errors": {"content": {"_errors": [error]}},
                },
                status=400,
            )
        if mode == "not_found":
            return _json({"message": "Unknown Channel", "code": 10003}, status=404)
        if mode == "unauthorized":
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        if mode == "expired":
            # An interaction token past its 15 minutes, as Discord answers a webhook call.
            return _json({"message": "Invalid Webhook Token", "code": 50027}, status=401)
        if mode == "no_route":
            return _json({"message": "404: Not Found", "code": 0}, status=404)
        if mode == "not_discord":
            return web.Response(
                status=404, text="<html><h1>Not Found</h1></html>", content_type="text/html"
            )
        if mode == "portal":
            return portal_page()
        raise ValueError(f"unknown stand-in mode {mode!r}")

    _respond = staticmethod(_json)

    # -- REST ------------------------------------------------------------------------------

    async def _users_me(self, request: web.Request) -> web.Response:
        await self._latency()
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        return _json(self.bot_user())

    async def _application_me(self, request: web.Request) -> web.Response:
        await self._latency()
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        return _json(
            {
                "id": self.application_id,
                "name": "leadgate",
                "icon": None,
                "description": "",
                "summary": "",
                "type": None,
                "bot_public": True,
                "bot_require_code_grant": False,
                "verify_key": "0" * 64,
                "flags": 0,
                "owner": {
                    "id": "1100000000000000009",
                    "username": "owner",
                    "discriminator": "0",
                    "avatar": None,
                },
                "bot": self.bot_user(),
                "team": None,
            }
        )

    async def _gateway_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "url": self.gateway_url,
                "shards": 1,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": 1000,
                    "reset_after": 0,
                    "max_concurrency": 1,
                },
            }
        )

    async def _create_message(self, request: web.Request) -> web.StreamResponse:
        channel_id = request.match_info["channel_id"]
        body = await request.json()
        await self._latency()
        mode = self._next_mode(channel_id)
        nonce = body.get("nonce")
        await self._posting(
            {
                "op": "create_message",
                "channel_id": channel_id,
                "content": body.get("content"),
                "nonce": nonce,
                "enforce_nonce": body.get("enforce_nonce"),
                "message_reference": body.get("message_reference"),
                "mode": mode,
            }
        )
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        failure = await self._failure(request, mode)
        if failure is not None:
            return failure
        content = body.get("content") or ""
        if len(content) > 2000:
            return _json(
                {
                    "message": "Invalid Form Body",
                    "code": 50035,
                    "errors": {
                        "content": {
                            "_errors": [
                                {
                                    "code": "BASE_TYPE_MAX_LENGTH",
                                    "message": "Must be 2000 or fewer in length.",
                                }
                            ]
                        }
                    },
                },
                status=400,
            )
        now = time.monotonic()
        if nonce is not None and body.get("enforce_nonce"):
            seen = self._nonces.get((channel_id, str(nonce)))
            if seen is not None and now - seen[0] < self.nonce_window_s:
                return _json(seen[1])
        reference = body.get("message_reference")
        message = self._message(
            channel_id=channel_id,
            content=content,
            nonce=str(nonce) if nonce is not None else None,
            message_reference=reference,
            guild_id=(reference or {}).get("guild_id"),
        )
        if nonce is not None and body.get("enforce_nonce"):
            self._nonces[(channel_id, str(nonce))] = (now, message)
        self._keep(message)
        self.posts.append(
            {
                "op": "create_message",
                "id": message["id"],
                "channel_id": channel_id,
                "content": content,
                "nonce": nonce,
                "enforce_nonce": body.get("enforce_nonce"),
                "message_reference": reference,
                "components": body.get("components") or [],
            }
        )
        return _json(message)

    async def _read_messages(self, request: web.Request) -> web.StreamResponse:
        """``GET /channels/{id}/messages``: newest first, as Discord answers."""
        channel_id = request.match_info["channel_id"]
        await self._latency()
        queued = self._read_modes.get(channel_id)
        mode = queued.pop(0) if queued else "ok"
        query = request.query
        record = {
            "channel_id": channel_id,
            "after": query.get("after"),
            "before": query.get("before"),
            "limit": query.get("limit"),
            "mode": mode,
        }
        self.reads.append(record)
        if self.on_read is not None:
            await self.on_read(record)
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        failure = await self._failure(request, mode)
        if failure is not None:
            return failure
        limit_text = query.get("limit", "50")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
            return _json({"message": "Invalid Form Body", "code": 50035}, status=400)
        limit = int(limit_text)
        kept = self._history.get(channel_id, [])
        if "after" in query:
            after = int(query["after"])
            page = [m for m in kept if int(m["id"]) > after][:limit]
        elif "before" in query:
            before = int(query["before"])
            page = [m for m in kept if int(m["id"]) < before][-limit:]
        else:
            page = kept[-limit:]
        # Discord keeps no nonce with a message: only the create's answer and the
        # gateway's MESSAGE_CREATE carry it, never a read of the channel's messages.
        return _json([{k: v for k, v in m.items() if k != "nonce"} for m in reversed(page)])

    def _thread(self, thread_id: str) -> dict[str, Any]:
        """A thread channel object, as Discord serves one."""
        kept = self._history.get(thread_id, [])
        return {
            "id": thread_id,
            "type": 12 if thread_id in self._private else 11,
            "guild_id": self._guilds[thread_id],
            "parent_id": self._threads[thread_id],
            "name": f"thread-{thread_id}",
            "owner_id": "1100000000000000100",
            "last_message_id": kept[-1]["id"] if kept else None,
            "message_count": len(kept),
            "member_count": 1,
            "rate_limit_per_user": 0,
            "flags": 0,
            "thread_metadata": {
                "archived": thread_id in self._archived,
                "auto_archive_duration": 60,
                "archive_timestamp": (
                    _iso(self._archived[thread_id]) if thread_id in self._archived else _now_iso()
                ),
                "locked": False,
            },
        }

    async def _active_threads(self, request: web.Request) -> web.StreamResponse:
        """``GET /guilds/{id}/threads/active``: the guild's threads (all active here),
        newest first, as Discord answers."""
        guild_id = request.match_info["guild_id"]
        await self._latency()
        self.thread_reads.append(guild_id)
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        queued = self._read_modes.get(f"guild:{guild_id}")
        failure = await self._failure(request, queued.pop(0) if queued else "ok")
        if failure is not None:
            return failure
        threads = sorted(
            (
                t
                for t in self._threads
                if self._guilds.get(t) == guild_id and t not in self._archived
            ),
            key=int,
            reverse=True,
        )
        return _json({"threads": [self._thread(t) for t in threads], "members": []})

    async def _archived_threads(self, request: web.Request) -> web.StreamResponse:
        """``GET /channels/{id}/threads/archived/public`` (and ``.../users/@me/threads/
        archived/private``, its private ones): the channel's archived threads, the latest
        archived first, archived before ``before`` (ISO8601), ``limit`` of
        them, and whether there are more."""
        channel_id = request.match_info["channel_id"]
        private = request.path.endswith("/private")
        await self._latency()
        (self.private_reads if private else self.archived_reads).append(channel_id)
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        queued = self._read_modes.get(f"{'private' if private else 'archived'}:{channel_id}")
        failure = await self._failure(request, queued.pop(0) if queued else "ok")
        if failure is not None:
            return failure
        if channel_id in self._threads:
            body = {"message": "Cannot execute action on this channel type", "code": 50024}
            return _json(body, status=400)
        try:
            limit = int(request.query.get("limit", "50"))
            before = request.query.get("before")
            until = datetime.fromisoformat(before).timestamp() * 1000 if before else None
        except ValueError:
            return _json({"message": "Invalid Form Body", "code": 50035}, status=400)
        if not 2 <= limit <= 100:
            return _json({"message": "Invalid Form Body", "code": 50035}, status=400)
        archived = sorted(
            (
                (at, t)
                for t, at in self._archived.items()
                if self._threads.get(t) == channel_id
                and (until is None or at < until)
                and (t in self._private) == private
            ),
            reverse=True,
        )
        page = [self._thread(t) for _, t in archived[:limit]]
        return _json({"threads": page, "members": [], "has_more": len(archived) > limit})

    async def _get_channel(self, request: web.Request) -> web.StreamResponse:
        """``GET /channels/{id}``: a channel some message was seen in."""
        channel_id = request.match_info["channel_id"]
        await self._latency()
        queued = self._lookup_modes.get(channel_id)
        mode = queued.pop(0) if queued else "ok"
        self.lookups.append((channel_id, mode))
        failure = await self._failure(request, mode)
        if failure is not None:
            return failure
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        if channel_id not in self._guilds:
            return _json({"message": "Unknown Channel", "code": 10003}, status=404)
        guild_id = self._guilds[channel_id]
        if channel_id in self._threads:
            return _json(self._thread(channel_id))
        if guild_id is None:
            return _json({"id": channel_id, "type": 1, "last_message_id": None, "recipients": []})
        return _json(
            {
                "id": channel_id,
                "type": 0,
                "guild_id": guild_id,
                "name": f"channel-{channel_id}",
                "position": 0,
                "permission_overwrites": [],
                "nsfw": False,
                "topic": None,
                "last_message_id": None,
                "rate_limit_per_user": 0,
                "parent_id": None,
            }
        )

    async def _edit_message(self, request: web.Request) -> web.StreamResponse:
        channel_id = request.match_info["channel_id"]
        message_id = request.match_info["message_id"]
        body = await request.json()
        await self._latency()
        mode = self._next_mode(channel_id)
        self.requests.append(
            {"op": "edit_message", "channel_id": channel_id, "message_id": message_id, "mode": mode}
        )
        if not self._bot_authorized(request):
            return _json({"message": "401: Unauthorized", "code": 0}, status=401)
        failure = await self._failure(request, mode)
        if failure is not None:
            return failure
        content = body.get("content") or ""
        self.posts.append(
            {
                "op": "edit_message",
                "channel_id": channel_id,
                "message_id": message_id,
                "content": content,
                "components": body.get("components") or [],
            }
        )
        return _json(self._message(channel_id=channel_id, content=content, message_id=message_id))

    async def _webhook_write(
        self, request: web.Request, op: str
    ) -> tuple[dict[str, Any], web.StreamResponse | None]:
        token = request.match_info["token"]
        body: dict[str, Any] = {}
        if request.can_read_body:
            raw = await request.read()
            body = json.loads(raw) if raw else {}
        await self._latency()
        mode = self._next_mode(token)
        self.requests.append(
            {
                "op": op,
                "application_id": request.match_info["app_id"],
                "token": token,
                "content": body.get("content"),
                "mode": mode,
            }
        )
        return body, await self._failure(request, mode)

    async def _followup(self, request: web.Request) -> web.StreamResponse:
        body, failure = await self._webhook_write(request, "followup")
        if failure is not None:
            return failure
        made_502 = self.requests[-1]["mode"] == "made_502"
        app_id, token = request.match_info["app_id"], request.match_info["token"]
        if app_id != self.application_id:
            return _json({"message": "Unknown Webhook", "code": 10015}, status=404)
        message = self._message(
            channel_id="0", content=body.get("content") or "", webhook_id=app_id
        )
        self.posts.append(
            {
                "op": "followup",
                "id": message["id"],
                "application_id": app_id,
                "token": token,
                "content": body.get("content"),
            }
        )
        if made_502:
            return web.Response(status=502, text="<html>502 Bad Gateway</html>")
        if request.query.get("wait") in ("1", "true", "True"):
            return _json(message)
        return web.Response(status=204)

    async def _get_original(self, request: web.Request) -> web.Response:
        token = request.match_info["token"]
        original = self._originals.get(token)
        if original is None:
            return _json({"message": "Unknown Message", "code": 10008}, status=404)
        return _json(original)

    async def _edit_original(self, request: web.Request) -> web.StreamResponse:
        body, failure = await self._webhook_write(request, "edit_original")
        if failure is not None:
            return failure
        app_id, token = request.match_info["app_id"], request.match_info["token"]
        if app_id != self.application_id or token in self._deleted_originals:
            return _json({"message": "Unknown Message", "code": 10008}, status=404)
        original = self._originals.get(token)
        if original is None:
            original = self._message(channel_id="0", content="", webhook_id=app_id)
        original = {**original, "content": body.get("content", original["content"])}
        original["edited_timestamp"] = _now_iso()
        self._originals[token] = original
        self.posts.append(
            {
                "op": "edit_original",
                "id": original["id"],
                "application_id": app_id,
                "token": token,
                "content": body.get("content"),
            }
        )
        return _json(original)

    async def _delete_original(self, request: web.Request) -> web.StreamResponse:
        _, failure = await self._webhook_write(request, "delete_original")
        if failure is not None:
            return failure
        app_id, token = request.match_info["app_id"], request.match_info["token"]
        if app_id != self.application_id or token in self._deleted_originals:
            return _json({"message": "Unknown Message", "code": 10008}, status=404)
        self._deleted_originals.add(token)
        self._originals.pop(token, None)
        self.posts.append({"op": "delete_original", "application_id": app_id, "token": token})
        return web.Response(status=204)

    # -- gateway ---------------------------------------------------------------------------

    async def _gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self._sockets.add(ws)
        try:
            # discord.py answers HELLO with a heartbeat, then IDENTIFY (or RESUME).
            await ws.send_str(json.dumps({"op": _HELLO, "d": {"heartbeat_interval": 41250}}))
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                frame = json.loads(msg.data)
                op = frame.get("op")
                if op == _HEARTBEAT:
                    await ws.send_str(json.dumps({"op": _HEARTBEAT_ACK}))
                elif op == _IDENTIFY:
                    data = frame.get("d") or {}
                    self.identifies.append(
                        {"token": data.get("token"), "intents": data.get("intents")}
                    )
                    if data.get("token") != self.token:
                        await ws.close(code=4004, message=b"Authentication failed.")
                        break
                    await self._send_dispatch(ws, "READY", self._ready_payload())
                    self._ready_sockets.add(ws)
                    self._ready.set()
                elif op == _RESUME:
                    await self._send_dispatch(ws, "RESUMED", {})
                    self._ready_sockets.add(ws)
                    self._ready.set()
        finally:
            self._sockets.discard(ws)
            self._ready_sockets.discard(ws)
            if not self._ready_sockets:
                self._ready.clear()
        return ws

    def _ready_payload(self) -> dict[str, Any]:
        return {
            "v": 10,
            "user": self.bot_user(),
            "guilds": [],
            "session_id": f"standin-session-{next(self._ids)}",
            "resume_gateway_url": self.gateway_url,
            "shard": [0, 1],
            "application": {"id": self.application_id, "flags": 0},
            "private_channels": [],
            "relationships": [],
            "user_settings": {},
        }

    async def _send_dispatch(self, ws: web.WebSocketResponse, event: str, data: Any) -> None:
        frame = {"op": _DISPATCH, "t": event, "s": next(self._seq), "d": data}
        await ws.send_str(json.dumps(frame))

    async def wait_gateway_ready(self, within_s: float = 5.0) -> None:
        """Wait until a client has identified and received READY."""
        async with asyncio.timeout(within_s):
            await self._ready.wait()

    async def invalidate_sessions(self) -> None:
        """INVALID_SESSION (not resumable) to every ready session: the client connects
        and identifies again, and gets a new READY."""
        for ws in list(self._ready_sockets):
            await ws.send_str(json.dumps({"op": _INVALID_SESSION, "d": False}))

    async def dispatch_guild_create(self, guild_id: str) -> None:
        """Send GUILD_CREATE for ``guild_id`` (the bot joined it, or it came back) with
        its active threads to every ready gateway session: discord.py caches the guild
        and the threads, and a message in one then comes as a :class:`discord.Thread`'s."""
        threads = [
            self._thread(t)
            for t in self._threads
            if self._guilds.get(t) == guild_id and t not in self._archived
        ]
        guild = {
            "id": guild_id,
            "name": f"guild-{guild_id}",
            "owner_id": "1100000000000000100",
            "roles": [],
            "emojis": [],
            "features": [],
            "channels": [],
            "members": [],
            "threads": threads,
            "member_count": 1,
        }
        for ws in list(self._ready_sockets):
            await self._send_dispatch(ws, "GUILD_CREATE", guild)

    async def dispatch_message_create(
        self,
        *,
        channel_id: str,
        content: str,
        guild_id: str | None = None,
        author_id: str = "1100000000000000100",
        author_name: str = "someone",
        author_bot: bool = False,
        message_id: str | None = None,
        at_ms: int | None = None,
    ) -> dict[str, Any]:
        """Post a message to the channel's history and send its MESSAGE_CREATE dispatch to
        every ready gateway session (with none, Discord delivers it to nobody: it is then
        only in the history). ``at_ms``: made then (its id's time), not now."""
        author: dict[str, Any] = {
            "id": author_id,
            "username": author_name,
            "discriminator": "0",
            "global_name": author_name,
            "avatar": None,
        }
        if author_bot:
            author["bot"] = True
        message = self._message(
            channel_id=channel_id,
            content=content,
            author=author,
            guild_id=guild_id,
            message_id=message_id or (self.new_snowflake(at_ms) if at_ms is not None else None),
        )
        self._keep(message)
        for ws in list(self._ready_sockets):
            await self._send_dispatch(ws, "MESSAGE_CREATE", message)
        return message

    # -- control API (beyond the shared /_standin/posts|requests|modes|reset) ---------------

    async def _gateway_state(self, request: web.Request) -> web.Response:
        return _json(
            {
                "connected": len(self._sockets),
                "ready": len(self._ready_sockets),
                "identifies": self.identifies,
            }
        )

    async def _http_message_create(self, request: web.Request) -> web.Response:
        body = await request.json()
        return _json(await self.dispatch_message_create(**body))


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.standins.discord_api --port 0 [--latency-ms N] [--token T]``."""
    serve_main(
        argv,
        lambda args: DiscordApiStandin(
            token=args.token,
            application_id=args.application_id,
            latency_ms=args.latency_ms,
            host=args.host,
            port=args.port,
        ),
        description="Discord REST + gateway stand-in",
        default_token="standin-bot-token",
        extra_options={"--application-id": "1100000000000000001"},
    )


if __name__ == "__main__":
    main()
