"""A Slack Web API stand-in on 127.0.0.1 that speaks the real wire protocol.

Use in-process::

    async with SlackApiStandin(token="xoxb-test") as slack:
        client = AsyncWebClient(token="xoxb-test", base_url=slack.api_url)
        slack.queue("ratelimited:7", "ok")      # next chat.postMessage calls, in order
        slack.set_channel_mode("C_GONE", "channel_not_found")   # sticky per channel
        ...
        slack.posts      # successful posts: [{"channel", "text", "thread_ts", "ts"}]
                         # (and "metadata", "blocks", ... when the post had them)
        slack.requests   # every chat.postMessage attempt, with the mode that answered it
        slack.on_post = hook   # awaited with each attempt's record before it is answered

or as a subprocess (for tests that run the service in another process)::

    python -m tests.standins.slack_api --port 0 [--latency-ms N] [--token T]
    # prints "LISTENING <port>"; api_url is http://127.0.0.1:<port>/api/

Review cards also use ``views.open``, ``chat.update`` and ``chat.postEphemeral`` (recorded
in ``calls``, with ``method``; ``chat.update`` and ``views.open`` answer ``hang``,
``reset``, ``drop``, a status, ``error:CODE`` and ``portal`` below too, keyed by channel;
``views.open`` only by its ``trigger_id``, with ``set_channel_mode``; and
``set_channel_mode("views.open", "invalid_arguments_echo")`` with Slack's refusal of a
view, quoting the view sent; a ``chat.postMessage`` or ``chat.update`` whose
``rich_text`` block lacks a field Slack documents as required is refused
``invalid_blocks``, :func:`rich_text_valid`) and a ``response_url``:
``POST /response/{anything}`` records the JSON body in ``calls`` with ``method``
``response_url`` (:meth:`SlackApiStandin.response_url` makes one;
:meth:`SlackApiStandin.lose_answer` makes its next posts land, recorded, and then reset
the connection unanswered, as an answer lost on the way back).

Reading back (a catch-up): each channel's messages are kept, those the test adds with
:meth:`SlackApiStandin.say` and the posts that landed, and ``conversations.history``
(parents, newest first, ``oldest``/``latest``/``inclusive``, ``limit``, ``cursor``) and
``conversations.replies`` (a thread, oldest first) answer from them as Slack does
(``ok``, ``messages``, ``has_more``, ``response_metadata.next_cursor``; a parent carries
``thread_ts``, ``reply_count``, ``reply_users``, ``reply_users_count`` and
``latest_reply`` once replied to; a post's ``metadata``, as Slack's message metadata,
only with ``include_all_metadata``). Every read is recorded in ``reads`` (``method``,
``channel``, ``oldest``, ``ts``, ``cursor``, ``mode``); ``fail_reads(channel, *modes)``
answers the channel's next reads in those modes (``ratelimited[:S]``, a status,
``error:CODE``), and ``on_read`` is awaited with each read's record before it is answered.

HTTP control endpoints (JSON): ``GET /_standin/posts`` (list of successful posts),
``GET /_standin/calls``, ``GET /_standin/requests`` (every attempt), ``POST /_standin/modes`` with
``{"queue": [mode, ...]}`` and/or ``{"channel": ID, "mode": MODE|null}``,
``POST /_standin/reset`` (clears records and modes).

Modes (``chat.postMessage``; ``auth.test`` always answers):

=====================  ==========================================================
``ok``                 post and answer ``{"ok": true, "ts": ...}``
``ratelimited[:S]``    HTTP 429, ``Retry-After: S`` (default 1), ``error=ratelimited``
``500`` (any 5xx)      that status with an HTML body, as Slack's edge answers
``error:CODE``         HTTP 200 ``{"ok": false, "error": CODE}``
``portal``             HTTP 200 with an HTML page, nothing posted: a captive portal's
                       or a proxy's answer, not Slack's (a login link with a session id)
``badjson``            HTTP 200 labelled ``application/json`` whose body is an HTML page
``channel_not_found``  shorthand for ``error:channel_not_found``
``hang``               read the request, never answer (until the stand-in stops)
``reset``              read the request, then reset the TCP connection (RST)
``drop``               read the request, then close the connection (FIN), unanswered
``trickle``            post, and answer a byte every ``TRICKLE_S`` (0.1 s), each
                       within a read timeout (the request's record: ``trickled``,
                       ``cut``)
=====================  ==========================================================

A wrong bearer token gets ``{"ok": false, "error": "invalid_auth"}``, none gets
``not_authed``.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from decimal import Decimal
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web
from slack_sdk.signature import SignatureVerifier

from tests.standins.common import (
    StandinBase,
    abort_with_reset,
    portal_page,
    serve_main,
    trickle,
)

__all__ = ["SlackApiStandin", "abort_with_reset", "signed_headers"]


def signed_headers(
    signing_secret: str, body: str, *, timestamp: int | None = None, retry_num: int | None = None
) -> dict[str, str]:
    """Headers Slack sends with an Events API request whose raw body is ``body``."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    signature = SignatureVerifier(signing_secret).generate_signature(timestamp=ts, body=body)
    assert signature is not None
    headers = {
        "Content-Type": "application/json",
        "X-Slack-Request-Timestamp": ts,
        "X-Slack-Signature": signature,
    }
    if retry_num is not None:
        headers["X-Slack-Retry-Num"] = str(retry_num)
        headers["X-Slack-Retry-Reason"] = "http_timeout"
    return headers


def _json(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(data),
        content_type="application/json",
        headers=headers,
    )


class SlackApiStandin(StandinBase):
    """Slack Web API (``auth.test``, ``chat.postMessage``, the reads of a catch-up) with
    scriptable failures."""

    def __init__(
        self,
        *,
        token: str = "xoxb-standin",
        team_id: str = "T0STANDIN",
        bot_user_id: str = "U0STANDIN",
        bot_id: str = "B0STANDIN",
        latency_ms: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.token = token
        self.team_id = team_id
        self.bot_user_id = bot_user_id
        self.bot_id = bot_id
        self._ts = itertools.count(1)
        #: views.open / chat.update / chat.postEphemeral / response_url calls, in order
        self.calls: list[dict[str, Any]] = []
        #: response_url name -> how many of its next posts land and go unanswered
        self._lost_answers: dict[str, int] = {}
        #: channel id -> its messages (parents and replies), in the order they came
        self.history: dict[str, list[dict[str, Any]]] = {}
        #: every conversations.history / conversations.replies call, with its mode
        self.reads: list[dict[str, Any]] = []
        #: awaited with each read's record before it is answered
        self.on_read: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        self._read_modes: dict[str, deque[str]] = {}
        super().__init__(latency_ms=latency_ms, host=host, port=port)

    def say(
        self,
        channel: str,
        text: str,
        *,
        at_ms: int | None = None,
        user: str = "U0HUMAN",
        thread_ts: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Keep a message posted to ``channel`` (at epoch millisecond ``at_ms``, now by
        default; in thread ``thread_ts``; ``fields`` such as ``bot_id`` or ``subtype``
        added as they are): Slack delivers it to no one here, the test does. The
        message, as ``conversations.history`` shows it (its ``ts`` unique)."""
        ms = int(time.time() * 1000) if at_ms is None else at_ms
        ts = f"{ms // 1000}.{(ms % 1000) * 1000 + next(self._ts) % 1000:06d}"
        message: dict[str, Any] = {
            "type": "message",
            "user": user,
            "text": text,
            "ts": ts,
            "team": self.team_id,
            **fields,
        }
        self._keep(channel, message, thread_ts)
        return message

    def _keep(self, channel: str, message: dict[str, Any], thread_ts: str | None) -> None:
        kept = self.history.setdefault(channel, [])
        kept.append(message)
        if not thread_ts or thread_ts == message["ts"]:
            return
        message["thread_ts"] = thread_ts
        message.setdefault("parent_user_id", "")
        for parent in kept:
            if parent["ts"] == thread_ts:
                message["parent_user_id"] = parent.get("user", "")
                parent["thread_ts"] = thread_ts
                parent["reply_count"] = parent.get("reply_count", 0) + 1
                users = parent.setdefault("reply_users", [])
                if message.get("user") and message["user"] not in users:
                    users.append(message["user"])
                parent["reply_users_count"] = len(users)
                parent["latest_reply"] = max(
                    parent.get("latest_reply", message["ts"]), message["ts"], key=Decimal
                )

    def fail_reads(self, channel: str, *modes: str) -> None:
        """Answer the next reads of ``channel`` (history and replies) in ``modes``."""
        self._read_modes.setdefault(channel, deque()).extend(modes)

    def reset(self) -> None:
        """Forget records (calls too) and modes."""
        super().reset()
        self.calls.clear()
        self._lost_answers.clear()
        self.history.clear()
        self.reads.clear()
        self._read_modes.clear()

    def response_url(self, name: str) -> str:
        """A ``response_url`` for an interaction payload (its posts land in ``calls``)."""
        return f"{self.base_url}/response/{name}"

    def lose_answer(self, name: str, count: int = 1) -> None:
        """The next ``count`` posts to the ``response_url`` named ``name`` land (recorded
        in ``calls``), then their connection is reset before any answer."""
        self._lost_answers[name] = self._lost_answers.get(name, 0) + count

    # -- control ---------------------------------------------------------------------------

    def set_channel_mode(self, channel: str, mode: str | None) -> None:
        """Answer every post to ``channel`` with ``mode`` (``None`` clears it)."""
        super().set_channel_mode(channel, mode)

    @property
    def api_url(self) -> str:
        """What ``AsyncWebClient(base_url=...)`` / ``[slack] api_url`` should be."""
        return f"{self.base_url}/api/"

    # -- lifecycle -------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        """The aiohttp application (routes of the Web API and of the control API)."""
        app = web.Application()
        app.router.add_post("/api/{method}", self._api)
        app.router.add_get("/api/{method}", self._api)
        app.router.add_post("/response/{name}", self._response_url)
        self._add_control_routes(app.router)
        app.router.add_get("/_standin/calls", self._get_calls)
        return app

    async def _get_calls(self, request: web.Request) -> web.Response:
        return _json(self.calls)

    async def _response_url(self, request: web.Request) -> web.Response:
        # Slack answers a response_url post with a bare "ok"; no Authorization is sent.
        body = await request.json()
        name = request.match_info["name"]
        self.calls.append(
            {
                "method": "response_url",
                "name": name,
                "authorization": request.headers.get("Authorization"),
                **body,
            }
        )
        if self._lost_answers.get(name):
            self._lost_answers[name] -= 1
            cut = await self._hang_or_reset(request, "reset")
            assert cut is not None
            return cut
        return web.Response(text="ok")

    async def _review_call(
        self, request: web.Request, method: str, params: dict[str, Any], auth_error: str | None
    ) -> web.StreamResponse:
        """views.open, chat.update, chat.postEphemeral."""
        if auth_error:
            return _json({"ok": False, "error": auth_error})
        channel = str(params.get("channel") or "")
        if method in ("chat.update", "views.open"):
            mode = (
                self._next_mode(channel)
                if method == "chat.update"
                # no channel, and not the queue (which posts take): by its trigger_id
                else self._key_modes.get(str(params.get("trigger_id") or ""), "ok")
            )
            cut = await self._hang_or_reset(request, mode)
            if cut is not None:
                return cut
            if mode.startswith("error:"):
                return _json({"ok": False, "error": mode.partition(":")[2]})
            if mode.isdigit():
                return web.Response(status=int(mode), text="error", content_type="text/html")
            if mode == "portal":
                return portal_page()
        if method == "views.open" and self._key_modes.get(method) == "invalid_arguments_echo":
            # Slack's answer to a view it refuses names what is wrong, quoting what was sent.
            said = f"[ERROR] failed to match all allowed schemas: {params.get('view')}"
            return _json(
                {
                    "ok": False,
                    "error": "invalid_arguments",
                    "response_metadata": {"messages": [said]},
                }
            )
        if method == "chat.update" and not rich_text_valid(params.get("blocks")):
            return _json({"ok": False, "error": "invalid_blocks"})
        self.calls.append({"method": method, **params})
        if method == "views.open":
            return _json({"ok": True, "view": {"id": f"V{next(self._ts):08d}"}})
        if method == "chat.update":
            return _json(
                {"ok": True, "channel": channel, "ts": params.get("ts"), "text": params.get("text")}
            )
        return _json({"ok": True, "message_ts": f"{int(time.time())}.{next(self._ts):06d}"})

    # -- Web API ---------------------------------------------------------------------------

    async def _api(self, request: web.Request) -> web.StreamResponse:
        params = await _read_params(request)
        await self._latency()
        method = request.match_info["method"]
        auth_error = self._check_token(request, params)
        if method == "auth.test":
            if auth_error:
                return _json({"ok": False, "error": auth_error})
            return _json(
                {
                    "ok": True,
                    "url": "https://standin.slack.com/",
                    "team": "Stand-in",
                    "user": "leadgate",
                    "team_id": self.team_id,
                    "user_id": self.bot_user_id,
                    "bot_id": self.bot_id,
                    "is_enterprise_install": False,
                }
            )
        if method in ("views.open", "chat.update", "chat.postEphemeral"):
            return await self._review_call(request, method, params, auth_error)
        if method in ("conversations.history", "conversations.replies"):
            return await self._read(method, params, auth_error)
        if method != "chat.postMessage":
            return _json({"ok": False, "error": "unknown_method"}, status=404)
        channel = str(params.get("channel") or "")
        text = params.get("text")
        thread_ts = params.get("thread_ts") or None
        mode = self._next_mode(channel)
        await self._posting(
            {"channel": channel, "text": text, "thread_ts": thread_ts, "mode": mode}
        )
        if auth_error:
            return _json({"ok": False, "error": auth_error})
        cut = await self._hang_or_reset(request, mode)
        if cut is not None:
            return cut
        if mode.startswith("ratelimited"):
            _, _, seconds = mode.partition(":")
            retry_after = seconds or "1"
            return _json(
                {"ok": False, "error": "ratelimited"},
                status=429,
                headers={"Retry-After": retry_after},
            )
        if mode.isdigit():
            return web.Response(
                status=int(mode),
                text=f"<html><body>{mode} server error</body></html>",
                content_type="text/html",
            )
        if mode.startswith("error:") or mode == "channel_not_found":
            code = mode.partition(":")[2] or mode
            return _json({"ok": False, "error": code})
        if mode == "portal":
            return portal_page()
        if mode == "badjson":
            return web.Response(text="<html>Bad gateway</html>", content_type="application/json")
        if not channel:
            return _json({"ok": False, "error": "channel_not_found"})
        if not text and not params.get("blocks"):
            return _json({"ok": False, "error": "no_text"})
        if not rich_text_valid(params.get("blocks")):
            return _json({"ok": False, "error": "invalid_blocks"})
        ts = f"{int(time.time())}.{next(self._ts):06d}"
        post = {"channel": channel, "text": text, "thread_ts": thread_ts, "ts": ts}
        for extra in ("blocks", "unfurl_links", "unfurl_media", "metadata"):
            if extra in params:
                post[extra] = params[extra]
        self.posts.append(post)
        if mode == "trickle":
            record = self.requests[-1]
            answer = {"ok": True, "channel": channel, "ts": ts}
            return await trickle(request, json.dumps(answer).encode(), record, self._release)
        message: dict[str, Any] = {
            "type": "message",
            "text": text,
            "user": self.bot_user_id,
            "bot_id": self.bot_id,
            "ts": ts,
        }
        if thread_ts:
            message["thread_ts"] = thread_ts
        kept = dict(message)
        if isinstance(params.get("metadata"), dict):
            # Kept with the message; a read shows it with include_all_metadata only.
            kept["metadata"] = params["metadata"]
        self._keep(channel, kept, thread_ts)
        return _json({"ok": True, "channel": channel, "ts": ts, "message": message})

    async def _read(
        self, method: str, params: dict[str, Any], auth_error: str | None
    ) -> web.Response:
        """conversations.history / conversations.replies, from ``history``."""
        channel = str(params.get("channel") or "")
        modes = self._read_modes.get(channel)
        mode = modes.popleft() if modes else "ok"
        record = {
            "method": method,
            "channel": channel,
            "oldest": params.get("oldest"),
            "ts": params.get("ts"),
            "cursor": params.get("cursor"),
            "mode": mode,
        }
        self.reads.append(record)
        if self.on_read is not None:
            await self.on_read(record)
        if auth_error:
            return _json({"ok": False, "error": auth_error})
        if mode.startswith("ratelimited"):
            retry_after = mode.partition(":")[2] or "1"
            return _json(
                {"ok": False, "error": "ratelimited"},
                status=429,
                headers={"Retry-After": retry_after},
            )
        if mode.isdigit():
            return web.Response(status=int(mode), text="error", content_type="text/html")
        if mode.startswith("error:"):
            return _json({"ok": False, "error": mode.partition(":")[2]})
        if channel not in self.history:
            return _json({"ok": False, "error": "channel_not_found"})
        kept = self.history[channel]
        inclusive = str(params.get("inclusive", "")).lower() in ("1", "true")
        oldest = Decimal(str(params.get("oldest") or "0"))
        latest = Decimal(str(params.get("latest") or "9" * 12))

        def within(message: dict[str, Any]) -> bool:
            ts = Decimal(message["ts"])
            if inclusive:
                return oldest <= ts <= latest
            return oldest < ts < latest

        if method == "conversations.history":
            # Parents (and replies also sent to the channel), newest first.
            found = [
                m
                for m in reversed(kept)
                if within(m)
                and (
                    m.get("thread_ts") in (None, m["ts"]) or m.get("subtype") == "thread_broadcast"
                )
            ]
        else:
            thread = str(params.get("ts") or "")
            if not any(m["ts"] == thread for m in kept):
                return _json({"ok": False, "error": "thread_not_found"})
            # The parent first, then its replies, oldest first.
            found = [
                m for m in kept if m["ts"] == thread or (m.get("thread_ts") == thread and within(m))
            ]
        if str(params.get("include_all_metadata", "")).lower() not in ("1", "true"):
            found = [{k: v for k, v in m.items() if k != "metadata"} for m in found]
        limit = max(1, min(int(params.get("limit") or 100), 999))
        start = int(base64.b64decode(params["cursor"]).decode()) if params.get("cursor") else 0
        page = found[start : start + limit]
        more = start + limit < len(found)
        cursor = base64.b64encode(str(start + limit).encode()).decode() if more else ""
        return _json(
            {
                "ok": True,
                "messages": page,
                "has_more": more,
                "response_metadata": {"next_cursor": cursor},
            }
        )

    def _check_token(self, request: web.Request, params: dict[str, Any]) -> str | None:
        header = request.headers.get("Authorization", "")
        token = header[7:].strip() if header.startswith("Bearer ") else params.get("token")
        if not token:
            return "not_authed"
        if token != self.token:
            return "invalid_auth"
        return None

    _respond = staticmethod(_json)


#: A rich_text block's parts, and the fields each rich text element Slack documents as
#: required (those a card uses; others pass unchecked).
_RICH_PARTS = ("rich_text_section", "rich_text_list", "rich_text_quote", "rich_text_preformatted")
_RICH_REQUIRED: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    "text": (("text", str),),
    "date": (("timestamp", (int, float)), ("format", str)),
}


def rich_text_valid(blocks: Any) -> bool:
    """Whether every ``rich_text`` block in ``blocks`` (a list, or its JSON as a form
    post sends it) has the shape Slack's reference documents: ``elements`` of rich text
    parts, each with its ``elements``, and each ``text`` or ``date`` element with its
    required fields of their types (Slack refuses others: ``invalid_blocks``)."""
    if isinstance(blocks, str):
        try:
            blocks = json.loads(blocks)
        except ValueError:
            return False
    for block in blocks if isinstance(blocks, list) else []:
        if not isinstance(block, dict) or block.get("type") != "rich_text":
            continue
        parts = block.get("elements")
        if not isinstance(parts, list) or not parts:
            return False
        for part in parts:
            if not isinstance(part, dict) or part.get("type") not in _RICH_PARTS:
                return False
            elements = part.get("elements")
            if not isinstance(elements, list):
                return False
            for element in elements:
                if not isinstance(element, dict):
                    return False
                for field, kind in _RICH_REQUIRED.get(str(element.get("type")), ()):
                    if not isinstance(element.get(field), kind):
                        return False
    return True


async def _read_params(request: web.Request) -> dict[str, Any]:
    """Merge query, JSON or form body, as the Web API accepts all three."""
    params: dict[str, Any] = dict(request.query)
    raw = await request.read()
    if not raw:
        return params
    if request.content_type == "application/json":
        data = json.loads(raw)
        if isinstance(data, dict):
            params.update(data)
    else:
        params.update(parse_qsl(raw.decode(), keep_blank_values=True))
    return params


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.standins.slack_api --port 0 [--latency-ms N] [--token T]``."""
    serve_main(
        argv,
        lambda args: SlackApiStandin(
            token=args.token, latency_ms=args.latency_ms, host=args.host, port=args.port
        ),
        description=__doc__.splitlines()[0] if __doc__ else None,
        default_token="xoxb-standin",
    )


if __name__ == "__main__":
    main()
