"""A Bot Framework Connector stand-in on 127.0.0.1, speaking the real REST wire protocol.

The Bot Framework SDK posts a bot's messages to the ``serviceUrl`` of the conversation:

* ``POST {serviceUrl}/v3/conversations/{conversationId}/activities/{activityId}``
  (a reply to ``activityId``; proactive continuations set a reply id too),
* ``POST {serviceUrl}/v3/conversations/{conversationId}/activities``.

Both answer ``{"id": ...}``. A review card is edited in place with
``PUT {serviceUrl}/v3/conversations/{conversationId}/activities/{activityId}`` (recorded
in ``updates``, answered ``{"id": activityId}``; failure modes apply to it as to a post). This
stand-in records every activity and can be told to fail the next requests in the ways
the real connector fails.

In-process use::

    standin = ConnectorStandin()
    await standin.start()
    standin.url                      # "http://127.0.0.1:PORT" (the serviceUrl)
    standin.fail_next("429", retry_after=7)
    ...
    standin.activities               # answered posts, oldest first
    standin.requests                 # every post, including the failed ones
    await standin.close()

As a subprocess (acceptance tests)::

    python -m tests.standins.connector --port 0      # prints "LISTENING <port>"

Control endpoints (the same in both modes):

* ``GET  /_standin/activities``  -> JSON list of answered posts (see :meth:`_record`)
* ``GET  /_standin/requests``    -> JSON list of every post, with its ``mode``
* ``GET  /_standin/updates``     -> JSON list of answered PUTs (card updates)
* ``POST /_standin/fail``        -> body ``{"mode": ..., "count": 1, "retry_after": 3}``
* ``POST /_standin/reset``       -> clears records and pending failures

Failure modes (each consumes one post or PUT): ``"429"`` (Too Many Requests with
``Retry-After``; ``"503"`` carries one too when ``retry_after`` is given), ``"408"``,
``"412"``, ``"500"``, ``"502"``, ``"503"``, ``"504"``, ``"401"``, ``"403"``, ``"404"``,
``"hang"`` (reads the request, never answers until :meth:`release_hangs` or close),
``"trickle"`` (posts, and answers ``200``
one byte every ``TRICKLE_S``, each within a read timeout, the whole answer
:data:`TRICKLE_BYTES` long; the record's ``trickled`` and ``cut`` tell how it went),
``"reset"`` (reads the request, then aborts the TCP connection), ``"badrecord"`` (over
TLS: reads the request, then answers with a TLS record that does not decrypt and
aborts), ``"portal"`` (200 with an HTML
page, nothing posted: a captive portal's or a proxy's answer, not the Connector's),
``"proxy404"``, ``"proxy502"``, ``"proxy503"`` (that status with a proxy's HTML page),
``"503_quoting"`` (a 503 whose error message quotes the activity's text).

It also offers :func:`message_activity` and :func:`post_activity` to build and POST an
inbound Teams message activity to a bot's ``/api/messages``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import ssl
import sys
import uuid
from collections import deque
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from tests.standins.common import portal_page, trickle

#: Answers with an HTML page instead of the Connector's JSON, by mode: their status.
PAGES = {"portal": 200, "proxy404": 404, "proxy502": 502, "proxy503": 503}
FAILURE_MODES = frozenset(
    {
        *("408", "412", "429", "500", "502", "503", "504", "401", "403", "404"),
        *("503_quoting", "hang", "trickle", "reset", "badrecord", *PAGES),
    }
)
#: Mode "trickle": how many bytes the answer has (one every TRICKLE_S).
TRICKLE_BYTES = 60


class ConnectorStandin:
    """An aiohttp server answering the Connector's ``activities`` endpoints."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self.port = port
        #: served over TLS with this context (``https`` service URL) when set
        self.ssl_context = ssl_context
        #: answered posts, oldest first
        self.activities: list[dict[str, Any]] = []
        #: every post (answered or failed), oldest first
        self.requests: list[dict[str, Any]] = []
        #: answered PUTs (activity updates), oldest first
        self.updates: list[dict[str, Any]] = []
        self._failures: deque[tuple[str, float | None]] = deque()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        # Hanging handlers wait on this so that close() can release them at once.
        self._closing = asyncio.Event()

    @property
    def url(self) -> str:
        """The ``serviceUrl`` to hand to the bot (no trailing slash)."""
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def fail_next(self, mode: str, *, count: int = 1, retry_after: float | None = None) -> None:
        """Make the next ``count`` posts fail with ``mode`` (see the module docstring)."""
        if mode not in FAILURE_MODES:
            raise ValueError(f"unknown failure mode {mode!r}")
        for _ in range(count):
            self._failures.append((mode, retry_after))

    def reset(self) -> None:
        """Forget records and pending failures."""
        self.activities.clear()
        self.requests.clear()
        self.updates.clear()
        self._failures.clear()

    def make_app(self) -> web.Application:
        """The aiohttp application (routes of the Connector and the control plane)."""
        app = web.Application()
        app.router.add_post("/v3/conversations/{conversation_id}/activities", self._post)
        app.router.add_post(
            "/v3/conversations/{conversation_id}/activities/{activity_id}", self._post
        )
        app.router.add_put(
            "/v3/conversations/{conversation_id}/activities/{activity_id}", self._put
        )
        app.router.add_get("/_standin/updates", self._get_updates)
        app.router.add_get("/_standin/activities", self._get_activities)
        app.router.add_get("/_standin/requests", self._get_requests)
        app.router.add_post("/_standin/fail", self._post_fail)
        app.router.add_post("/_standin/reset", self._post_reset)
        return app

    async def start(self) -> None:
        """Listen; ``self.port`` holds the bound port afterwards (port 0 allowed)."""
        # A short shutdown timeout: hanging handlers are released by _closing anyway.
        self._runner = web.AppRunner(self.make_app(), shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    def release_hangs(self) -> None:
        """Answer the requests ``"hang"`` holds (503), the stand-in still listening
        (and the next ``"hang"`` at once too)."""
        self._closing.set()

    async def close(self) -> None:
        """Stop listening and release hanging requests."""
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _record(self, request: web.Request, body: Any, mode: str) -> dict[str, Any]:
        return {
            "conversation_id": request.match_info["conversation_id"],
            "reply_to_id": request.match_info.get("activity_id"),
            "path": request.path,
            "authorization": request.headers.get("Authorization"),
            "activity": body,
            "mode": mode,
        }

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        mode, retry_after = self._failures.popleft() if self._failures else ("ok", None)
        record = self._record(request, body, mode)
        self.requests.append(record)
        if mode in ("ok", "trickle"):
            new_id = f"activity-{next(self._ids)}"
            record["id"] = new_id
            self.activities.append(record)
            if mode == "trickle":
                body = json.dumps({"id": new_id}).encode().ljust(TRICKLE_BYTES)
                return await trickle(request, body, record, self._closing)
            return web.json_response({"id": new_id})
        return await self._fail(request, mode, retry_after)

    async def _put(self, request: web.Request) -> web.StreamResponse:
        body = await _read_json(request)
        mode, retry_after = self._failures.popleft() if self._failures else ("ok", None)
        record = self._record(request, body, mode)
        self.requests.append(record)
        if mode == "ok":
            self.updates.append(record)
            return web.json_response({"id": request.match_info["activity_id"]})
        return await self._fail(request, mode, retry_after)

    async def _fail(
        self, request: web.Request, mode: str, retry_after: float | None
    ) -> web.StreamResponse:
        """Answer a request (read in full) the way failure ``mode`` says."""
        if mode == "hang":
            # Never answer (until the stand-in closes).
            await self._closing.wait()
            return web.Response(status=503)
        if mode == "reset":
            transport = request.transport
            if transport is not None:
                transport.abort()
            # Nothing can be written any more; aiohttp ignores a response on a dead socket.
            return web.Response(status=500)
        if mode == "badrecord":
            transport = request.transport
            sock = transport.get_extra_info("socket") if transport is not None else None
            if transport is not None and sock is not None:
                # Application data (type 23, TLS 1.2) that no key decrypts, written under
                # the TLS layer: the client's read fails with a TLS error.
                os.write(sock.fileno(), b"\x17\x03\x03\x00\x20" + bytes(32))
                transport.abort()
            return web.Response(status=500)
        if mode in PAGES:
            return _page(mode)
        if mode == "503_quoting":
            # The error's message quotes the activity it could not take (its text).
            body = await _read_json(request)
            text = body.get("text") if isinstance(body, dict) else None
            message = f"Service busy, not posted: {text}"
            return web.json_response(
                {"error": {"code": "ServiceError", "message": message}}, status=503
            )
        status = int(mode)
        headers = {}
        if status == 429 or (status == 503 and retry_after is not None):
            headers["Retry-After"] = str(int(retry_after) if retry_after is not None else 1)
        error = {"error": {"code": _ERROR_CODES.get(status, "ServiceError"), "message": mode}}
        return web.json_response(error, status=status, headers=headers)

    async def _get_updates(self, request: web.Request) -> web.Response:
        return web.json_response(self.updates)

    async def _get_activities(self, request: web.Request) -> web.Response:
        return web.json_response(self.activities)

    async def _get_requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.requests)

    async def _post_fail(self, request: web.Request) -> web.Response:
        spec = await request.json()
        try:
            self.fail_next(
                str(spec["mode"]),
                count=int(spec.get("count", 1)),
                retry_after=spec.get("retry_after"),
            )
        except (KeyError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"pending": len(self._failures)})

    async def _post_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})


async def _read_json(request: web.Request) -> Any:
    """The request's JSON body (its text when it is not JSON)."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _page(mode: str) -> web.Response:
    """The HTML page a captive portal (200) or a proxy answers instead of the Connector."""
    if mode == "portal":
        return portal_page(PAGES[mode])
    return web.Response(
        status=PAGES[mode], text="<html>Proxy Error</html>", content_type="text/html"
    )


_ERROR_CODES = {
    401: "Unauthorized",
    403: "BotNotInConversationRoster",
    404: "ConversationNotFound",
    412: "PreconditionFailed",
    429: "TooManyRequests",
    500: "ServiceError",
}


def message_activity(
    *,
    service_url: str,
    text: str,
    conversation_id: str = "19:general@thread.tacv2",
    tenant_id: str = "tenant-1",
    activity_id: str | None = None,
    user_id: str = "29:user-1",
    user_name: str = "Alice",
    bot_id: str = "28:leadgate-bot",
    bot_name: str = "leadgate",
    mention_bot: bool = False,
) -> dict[str, Any]:
    """An inbound Teams ``message`` activity as the channel would POST it.

    ``mention_bot`` prefixes ``<at>{bot_name}</at>`` and adds the mention entity, as Teams
    does when a user @mentions the bot in a channel.
    """
    entities: list[dict[str, Any]] = []
    if mention_bot:
        mention = f"<at>{bot_name}</at>"
        text = f"{mention} {text}"
        entities.append(
            {"type": "mention", "mentioned": {"id": bot_id, "name": bot_name}, "text": mention}
        )
    return {
        "type": "message",
        "id": activity_id or f"1{uuid.uuid4().int % 10**12:012d}",
        "timestamp": "2024-01-01T00:00:00.000Z",
        "serviceUrl": service_url,
        "channelId": "msteams",
        "from": {"id": user_id, "name": user_name, "aadObjectId": "00000000-0000-0000-0000-1"},
        "conversation": {
            "id": conversation_id,
            "conversationType": "channel",
            "tenantId": tenant_id,
        },
        "recipient": {"id": bot_id, "name": bot_name},
        "text": text,
        "textFormat": "plain",
        "locale": "en-US",
        "entities": entities,
        "channelData": {"tenant": {"id": tenant_id}},
    }


def invoke_activity(
    *,
    service_url: str,
    verb: str,
    data: dict[str, Any],
    reply_to_id: str,
    conversation_id: str,
    aad_object_id: str,
    tenant_id: str = "tenant-1",
    user_id: str = "29:user-1",
    bot_id: str = "28:leadgate-bot",
) -> dict[str, Any]:
    """An ``adaptiveCard/action`` invoke, as Teams POSTs it when someone clicks an
    ``Action.Execute`` button (``data`` already holds the card's inputs)."""
    return {
        "type": "invoke",
        "name": "adaptiveCard/action",
        "id": f"f:{uuid.uuid4().hex}",
        "timestamp": "2024-01-01T00:00:00.000Z",
        "serviceUrl": service_url,
        "channelId": "msteams",
        "from": {"id": user_id, "name": "Reviewer", "aadObjectId": aad_object_id},
        "conversation": {
            "id": conversation_id,
            "conversationType": "channel",
            "tenantId": tenant_id,
        },
        "recipient": {"id": bot_id, "name": "leadgate"},
        "replyToId": reply_to_id,
        "value": {
            "action": {"type": "Action.Execute", "id": "a1", "verb": verb, "data": data},
            "trigger": "manual",
        },
        "channelData": {"tenant": {"id": tenant_id}},
    }


async def post_activity(
    bot_url: str, activity: dict[str, Any], *, token: str | None = None, timeout_s: float = 15.0
) -> tuple[int, str]:
    """POST ``activity`` to ``bot_url`` (the bot's ``.../api/messages``): (status, body).

    ``token`` becomes ``Authorization: Bearer <token>``; None sends no Authorization.
    ``timeout_s`` is the Bot Framework Connector's own wait for a bot's answer (15 s):
    the service answers within 13 s of an activity's arrival, after its turn, and a
    turn on a loaded two-core CI host passed the 5 s this used to wait.
    """
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with (
        ClientSession(timeout=ClientTimeout(total=timeout_s)) as session,
        session.post(bot_url, data=json.dumps(activity), headers=headers) as resp,
    ):
        return resp.status, await resp.text()


async def _main(host: str, port: int) -> None:
    standin = ConnectorStandin(host, port)
    await standin.start()
    print(f"LISTENING {standin.port}", flush=True)
    stop = asyncio.Event()
    # SIGTERM (what a test harness sends) ends the process cleanly with exit code 0.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await standin.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.standins.connector --port 0``: prints ``LISTENING <port>``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_main(args.host, args.port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
