"""The service's aiohttp runner: a request aiohttp cannot parse is answered in the one JSON
error envelope, like every other refused request.

aiohttp answers such a request (a bad request line, header or body framing) itself, before
any handler or middleware runs, with a plain-text 400 that quotes the offending bytes back.
Its protocol handler has no hook for that answer and its server takes no handler class, so
this module subclasses the two (``RequestHandler.handle_error`` and ``Server.__call__``)
and builds the server the application runner made with the subclass. Hand-rolled because no
library covers it; ``tests/fuzz/test_request_edges.py`` sends such requests to the real
service, so an aiohttp upgrade that moves these hooks fails there, not in production.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from leadgate.web.common import SERVER_NAME, error_body

#: What a client is told about a request aiohttp could not parse: the rule, never its bytes.
MALFORMED_MESSAGE = (
    "the request is not valid HTTP/1.1 (its request line, a header or the body's framing)"
)


class _JsonErrorsHandler(RequestHandler):
    """aiohttp's per-connection protocol, answering its own errors as JSON."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # aiohttp's version logs (MalformedRequestFilter makes that one quiet line) and
        # raises when a response has already begun; its text answer is replaced.
        super().handle_error(request, status, exc, message)
        if status >= 500:
            # Not reached from our routes (error_middleware answers every exception);
            # kept in the envelope for anything aiohttp itself fails at.
            body = error_body(status, "internal error", "internal_error", "internal")
        else:
            body = error_body(status, MALFORMED_MESSAGE, "malformed_request", "http.malformed")
        response = web.json_response(body, status=status, headers={"Server": SERVER_NAME})
        response.force_close()
        return response


class _JsonErrorsServer(web.Server):
    """aiohttp's low-level server, making :class:`_JsonErrorsHandler` connections."""

    def __call__(self) -> RequestHandler:
        return _JsonErrorsHandler(self, loop=self._loop, **self._kwargs)


class ServiceRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer unparseable requests in the JSON
    envelope (rule ``http.malformed``) instead of aiohttp's plain text."""

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        # The same server (the application's handler and request factory, our keyword
        # arguments), built with the subclass.
        return _JsonErrorsServer(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )
