"""Shared HTTP plumbing: the one JSON error envelope, request ids, body parsing,
authentication, event stream slots."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from leadgate.core.auth import Principal
from leadgate.core.bodies import read_body
from leadgate.core.decoding import bearer_token, json_object
from leadgate.core.errors import (
    AuthError,
    DatabaseDamaged,
    LeadgateError,
    ModelError,
    Unavailable,
    ValidationError,
    when_reading,
)
from leadgate.core.logs import Tally, loggable
from leadgate.core.metrics import METRICS
from leadgate.database.faults import unavailable

log = logging.getLogger("leadgate.web")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION_COOKIE = "leadgate_session"


#: ``type`` of the error envelope per HTTP status (the OpenAI names, kept on every surface).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = web.RequestKey("request_id", str)
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def error_body(
    status: int,
    message: str,
    code: str | None,
    rule: str | None,
    *,
    type_: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """The one error envelope of every HTTP surface (REST, operator API, console, MCP):
    ``{"error": {"message", "type", "param", "code", "rule"}}`` — the OpenAI shape, plus
    ``rule``, the name of the rule that was broken."""
    error: dict[str, Any] = {
        "message": message,
        "type": type_ or ERROR_TYPES.get(status, "api_error" if status < 500 else "server_error"),
        "param": param,
        "code": code,
        "rule": rule,
    }
    return {"error": error}


def openai_error(
    status: int, message: str, type_: str, code: str | None, rule: str | None = None
) -> web.Response:
    """An error response with an explicit OpenAI ``type`` (see :func:`error_body`)."""
    return web.json_response(error_body(status, message, code, rule, type_=type_), status=status)


def error_response(
    request: web.Request,
    status: int,
    message: str,
    code: str,
    rule: str,
    *,
    param: str | None = None,
) -> web.Response:
    """A JSON error response in the one envelope (:func:`error_body`); 401 answers say
    ``WWW-Authenticate: Bearer``."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    response = web.json_response(
        error_body(status, message, code, rule, param=param), status=status, headers=headers
    )
    body = request.content
    if body.exception() is not None or not body.is_eof():
        # The body broke (bad gzip, broken chunks) or was never all sent (too large, too
        # slow, refused before it was read): aiohttp closes such a connection after the
        # answer anyway. Saying so (``Connection: close``) keeps a keep-alive client from
        # sending its next request into the closing socket, where it was reset.
        response.force_close()
    return response


def request_id(request: web.Request) -> str:
    """The request's id: the client's ``X-Request-Id`` when it is a sane token, else a
    new one. Logged with every line of the request and returned in the same header."""
    if REQUEST_ID in request:
        return request[REQUEST_ID]
    offered = request.headers.get(REQUEST_ID_HEADER, "")
    # 128 random bits as 32 hex digits: what uuid4().hex gave, without its Python work.
    rid = offered if offered and _REQUEST_ID_OK.fullmatch(offered) else os.urandom(16).hex()
    request[REQUEST_ID] = rid
    return rid


#: ``Server`` of every response: the product, without aiohttp's and Python's versions
#: (which only help someone match a request to a known flaw).
SERVER_NAME = "leadgate"


async def stamp_response(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: every response (streams too) carries ``X-Request-Id``
    and ``Server: leadgate``; a JSON answer that says nothing of caching is ``no-store``
    and ``nosniff``: every one is for the caller who asked (a review's detail, a
    transcript), never for a shared cache or the browser's back button."""
    headers = response.headers
    headers[REQUEST_ID_HEADER] = request_id(request)
    headers["Server"] = SERVER_NAME
    if response.content_type == "application/json" and "Cache-Control" not in headers:
        headers["Cache-Control"] = "no-store"
        headers["X-Content-Type-Options"] = "nosniff"


# The official OpenAI clients retry a 409 and every 5xx by default, which would resend a
# turn that was taken in; this header, which they obey, says not to.
NO_RETRY = {"x-should-retry": "false"}


def spread_wait_ms(retry_after_s: int, jitter: float) -> int:
    """The wait a 503 asks for, in milliseconds: its rule's ``retry_after_s`` plus up to
    2 s more (``jitter`` in [0, 1); see :class:`UnavailableAnswers`)."""
    return retry_after_s * 1000 + int(2000 * jitter)


def retry_headers(wait_ms: int) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` (exact, which
    the OpenAI clients read first) for a wait of ``wait_ms``."""
    return {"Retry-After": str(-(-wait_ms // 1000)), "retry-after-ms": str(wait_ms)}


class UnavailableAnswers:
    """How an application answers a 503 (``app[UNAVAILABLE_ANSWERS]``), whatever its rule:
    a database fault (``service.unavailable``), overload (``server.busy``,
    ``events.limit``, ``console.login_busy``).

    * The wait asked for is the error's ``retry_after_s`` plus up to 2 s more, drawn at
      random (``Retry-After`` in whole seconds, ``retry-after-ms`` exactly, which the
      OpenAI clients read first): one fixed wait sent every refused client back at the
      same moment (a throwaway probe, 2,000 official-client calls at once against an
      in-flight limit of 50: 985 still refused after the client's two retries; 146 with
      the spread).
    * The WARNING lines: one per rule every 10 s at most, with how many there were, the
      latest request and what the database said (clients never see that). An outage's
      clients retry by the thousand; a line each would add to it, and an ERROR each
      would page someone for every retry.
    * ``leadgate_unavailable_responses_total{rule}``.
    * A GET or HEAD only reads: a database fault tells it so (:func:`when_reading`), not
      that nothing was stored.
    * An error that asks for no retry (``retry_after_s`` ``None``: ``turn.interrupted``,
      whose message was stored) has neither header, and ``x-should-retry: false``.
    """

    def __init__(
        self,
        *,
        now: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._now = now
        self._jitter = jitter
        self._by_rule: dict[str, Tally] = {}

    def answer(self, request: web.Request, exc: Unavailable) -> web.Response:
        """The 503 for ``exc`` (counted; logged now and then)."""
        METRICS.unavailable.labels(exc.rule).inc()
        tally = self._by_rule.get(exc.rule)
        if tally is None:
            tally = self._by_rule[exc.rule] = Tally(
                log, "%d request(s) answered 503 [%s] (the latest: %s %s%s)", now=self._now
            )
        tally.add(exc.rule, request.method, request.path, f": {exc.detail}" if exc.detail else "")
        if request.method in _ONLY_READ:
            exc = when_reading(exc)
        response = error_response(request, exc.status, exc.message, exc.code, exc.rule)
        if exc.retry_after_s is None:
            # turn.interrupted: the message was stored; a retry would send it twice.
            response.headers.update(NO_RETRY)
        else:
            response.headers.update(
                retry_headers(spread_wait_ms(exc.retry_after_s, self._jitter()))
            )
        return response


#: Methods whose routes only read: told a fault as :data:`CANNOT_READ`, not "nothing
#: was stored" (a console page, a listing, a transcript, an event stream).
_ONLY_READ = frozenset({"GET", "HEAD"})

UNAVAILABLE_ANSWERS = web.AppKey("leadgate_unavailable_answers", UnavailableAnswers)
#: For applications without their own (the service's have one each).
_SHARED_ANSWERS = UnavailableAnswers()


def unavailable_response(request: web.Request, exc: Unavailable) -> web.Response:
    """The 503 for ``exc``, as the application answers them (:class:`UnavailableAnswers`)."""
    answers = request.config_dict.get(UNAVAILABLE_ANSWERS) or _SHARED_ANSWERS
    return answers.answer(request, exc)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON error; nothing crashes the process or leaks internals.

    Each log line of the request carries its ``request_id``. A 5xx is logged once here
    (an unexpected exception with its traceback); a model or provider error is logged
    once where it happens (the turn path), so not again here.
    """
    # bind/reset rather than bound_contextvars(), which copies the whole context to save
    # and restore keys this middleware alone sets.
    tokens = structlog.contextvars.bind_contextvars(request_id=request_id(request))
    try:
        # No id, name or search term holds a NUL, and PostgreSQL text cannot: a path
        # parameter or query value with one failed in the driver there (a 500). The raw
        # target still has it percent-encoded; aiohttp refuses a literal one.
        if "%00" in request.raw_path:
            raise ValidationError("the URL holds a NUL character (%00)", rule="url.nul")
        return await handler(request)
    except LeadgateError as exc:
        return error_answer(request, exc)
    except web.HTTPRequestEntityTooLarge:
        return error_response(
            request, 413, "the request body is too large", "request_too_large", "body.size"
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        answer = error_response(request, exc.status, exc.reason, "http_error", "http")
        if "Allow" in exc.headers:
            # A 405 must say which methods the path takes (RFC 9110 15.5.6).
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer
    except ConnectionError as exc:
        transport = request.transport
        if transport is None or transport.is_closing():
            # The client went away while its answer was written: nobody to answer, no
            # fault of ours or the database's (it was counted as a database 503). 499 is
            # nginx's "client closed request"; aiohttp drops the answer quietly (raising
            # instead, aiohttp logged an ERROR with a traceback).
            log.info("%s %s: the client went away", request.method, request.path)
            return web.Response(status=499)
        return error_answer(request, exc)
    except Exception as exc:
        return error_answer(request, exc)
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


def error_answer(request: web.Request, exc: BaseException) -> web.Response:
    """The one answer of the service to ``exc`` (the error middleware's, and a handler's
    that answers a failure itself, as a chat completion does after its intake):

    * :class:`Unavailable`: a 503 as :class:`UnavailableAnswers` gives it;
    * :class:`DatabaseDamaged`: a 500 as :class:`DamagedAnswers` gives it;
    * another :class:`LeadgateError`: its status and rule (a 5xx logged once here, but a
      model error, logged where it happened);
    * anything else: a 503 for a database fault that escaped the transaction helpers,
      else a 500 logged with its traceback (call it while ``exc`` is being handled).
    """
    if isinstance(exc, Unavailable):
        return unavailable_response(request, exc)
    if isinstance(exc, DatabaseDamaged):
        return _damaged_response(request, exc)
    if isinstance(exc, LeadgateError):
        if exc.status >= 500 and not isinstance(exc, ModelError):
            log.error(
                "%s %s failed: %d %s [%s]",
                request.method,
                request.path,
                exc.status,
                exc.code,
                exc.rule,
            )
        resp = error_response(request, exc.status, exc.message, exc.code, exc.rule)
        if exc.retry_after_s is not None:
            resp.headers["Retry-After"] = str(exc.retry_after_s)
        return resp
    fault = unavailable(exc)
    if fault is not None:
        return unavailable_response(request, fault)
    log.error("unhandled error on %s %s", request.method, request.path, exc_info=loggable(exc))
    return error_response(request, 500, "internal error", "internal_error", "internal")


class DamagedAnswers:
    """How an application answers a request that met a damaged database (a SQLite
    file, or PostgreSQL data or an index: :class:`DatabaseDamaged`,
    ``app[DAMAGED_ANSWERS]``): 500 ``database.file`` with ``x-should-retry: false`` (the
    official clients retry a 500 twice otherwise, and nothing but repairing the database
    ends this one), and no ``Retry-After``.

    The ERROR lines: one a minute at most, naming the file or database, with how many
    requests met it since the last line and the latest of them; no traceback (the
    driver's, which says nothing an operator can act on, was logged for every
    request)."""

    def __init__(self, *, now: Callable[[], float] = time.monotonic) -> None:
        self._tally = Tally(
            log,
            "%d request(s) met a damaged database [database.file] (the latest: %s %s): %s",
            every_s=60.0,
            now=now,
            level=logging.ERROR,
        )

    @property
    def answered(self) -> int:
        """Requests answered so far."""
        return self._tally.total

    def note(self, request: web.Request, exc: DatabaseDamaged) -> None:
        """Count ``exc`` met by ``request`` (logged now and then): where no answer can
        carry it too, as in an event stream already under way."""
        self.note_for(request.method, request.path, exc)

    def note_for(self, method: str, path: str, exc: DatabaseDamaged) -> None:
        """:meth:`note` for a request known by its method and path only (one whose
        object is not to be kept, as MCP's)."""
        self._tally.add(method, path, exc.detail)

    def answer(self, request: web.Request, exc: DatabaseDamaged) -> web.Response:
        """The 500 for ``exc`` (counted; logged now and then)."""
        self.note(request, exc)
        response = error_response(request, exc.status, exc.message, exc.code, exc.rule)
        response.headers.update(NO_RETRY)
        return response


DAMAGED_ANSWERS = web.AppKey("leadgate_damaged_answers", DamagedAnswers)
_SHARED_DAMAGED = DamagedAnswers()


def damaged_answers(request: web.Request) -> DamagedAnswers:
    """The application's :class:`DamagedAnswers` (a shared one for an application
    without its own)."""
    return request.config_dict.get(DAMAGED_ANSWERS) or _SHARED_DAMAGED


def _damaged_response(request: web.Request, exc: DatabaseDamaged) -> web.Response:
    """The 500 for ``exc``, as the application answers them (:class:`DamagedAnswers`)."""
    return damaged_answers(request).answer(request, exc)


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body through the one decoding path
    (:mod:`leadgate.core.decoding`: 400 naming the rule, 413 too large, 408 too slow)."""
    return json_object(await read_body(request))


class Inflight:
    """The requests a process is answering at once, at most ``limit`` (``[server]
    max_inflight``). Beyond it a request is answered 503 ``server.busy`` at once, before
    its body is read: an overloaded service sheds what it cannot take instead of queueing
    every request until clients time out, and the official clients retry a 503 after the
    wait it names (:class:`UnavailableAnswers`). ``/healthz`` and ``/metrics`` are always
    answered. A long-lived stream stops counting once it holds a slot of its own bound
    (:meth:`StreamSlots.take`, :func:`detach_stream`).
    """

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self.count = 0
        #: requests refused so far
        self.shed = 0


INFLIGHT = web.AppKey("leadgate_inflight", Inflight)
_DETACHED = web.RequestKey("leadgate_detached", bool)
#: Answered however busy the process is: monitoring must see an overloaded service.
_ALWAYS_ANSWERED = frozenset({"/healthz", "/metrics"})


def inflight_middleware(inflight: Inflight) -> Middleware:
    """The middleware counting requests against ``inflight`` (inside
    :func:`error_middleware`, which answers its 503)."""

    @web.middleware
    async def bounded(request: web.Request, handler: Handler) -> web.StreamResponse:
        if inflight.count >= inflight.limit and request.path not in _ALWAYS_ANSWERED:
            inflight.shed += 1
            raise Unavailable(
                "the service is answering as many requests as it can; try again shortly",
                rule="server.busy",
                retry_after_s=1,
            )
        inflight.count += 1
        try:
            return await handler(request)
        finally:
            if _DETACHED not in request:
                inflight.count -= 1

    return bounded


def detach_stream(request: web.Request) -> None:
    """``request`` is a long-lived stream bounded by a limit of its own (event streams,
    the operator feed, an MCP ``GET`` stream): it no longer counts as in flight."""
    inflight = request.config_dict.get(INFLIGHT)
    if inflight is not None and _DETACHED not in request:
        request[_DETACHED] = True
        inflight.count -= 1


class StreamSlots:
    """The event streams of one kind a process has open, at most ``limit`` (session
    events: ``[api] events_max_streams``; the operator feed: 256): each holds a
    connection, a file descriptor and memory (about 17 KB for a session's).

    A slot is taken before a new stream's first await (its session lookup, the
    PostgreSQL watch mark), so a burst of opens cannot all pass the check before any of
    them is counted, and it is given back however the stream ends.
    """

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self.taken = 0

    @contextlib.contextmanager
    def take(self, request: web.Request) -> Iterator[None]:
        """Hold a slot for ``request``'s stream for the block; 503 ``events.limit`` when
        none is free. Holding one, the stream no longer counts as in flight."""
        if self.taken >= self.limit:
            raise Unavailable(
                "too many live event streams; try again soon", rule="events.limit", retry_after_s=5
            )
        detach_stream(request)
        self.taken += 1
        try:
            yield
        finally:
            self.taken -= 1


def require_console_header(request: web.Request) -> None:
    """Cookie-authenticated writes must come from our own page (CSRF): a cross-site form
    cannot set a custom header, and a cross-site fetch with one needs CORS we never grant."""
    if request.headers.get("X-Leadgate-Console") != "1":
        raise AuthError("console requests must carry X-Leadgate-Console: 1", rule="csrf")


def session_cookie(request: web.Request) -> str | None:
    """The console session cookie's value, or ``None`` when it is missing or is not
    printable ASCII (the tokens this service issues always are). A cookie's other bytes
    reach us as surrogate escapes, which the token's hash could not encode (a 500): such
    a cookie is as good as none, so the request is refused as not logged in."""
    value = request.cookies.get(SESSION_COOKIE)
    if not value or len(value) > 256 or not value.isascii() or not value.isprintable():
        return None
    return value


PrincipalLookup = Callable[[str | None, str | None], Awaitable[Principal | None]]


async def authenticate(request: web.Request, lookup: PrincipalLookup, *, cookie: bool) -> Principal:
    """Bearer key, or (where allowed) the console session cookie. 401 otherwise."""
    token = bearer_token(request)
    session = session_cookie(request) if cookie and token is None else None
    if cookie and session and request.method not in ("GET", "HEAD"):
        require_console_header(request)
    principal = await lookup(token, session)
    if principal is None:
        if cookie and token is None and request.cookies.get(SESSION_COOKIE):
            # A console page whose session ended: say that, not "an API key is required".
            raise AuthError(
                "the console session has ended or is not valid: log in again",
                rule="console.session",
            )
        raise AuthError(
            "a valid API key is required (Authorization: Bearer <key>)", rule="auth.key"
        )
    return principal


# Hand-rolled rather than aiohttp-remotes: its strict mode wants the exact list of hops
# and answers 400 otherwise, its relaxed one trusts whatever hop count it is given; the
# rule needed here is the usual "right-most address that is not one of our proxies",
# which is these few lines over the standard library's ipaddress.
class ClientAddress:
    """The address a request comes from, seen through the trusted proxies in front."""

    def __init__(self, trusted_proxies: Sequence[str] = ()) -> None:
        self._trusted = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]

    def _is_proxy(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted)

    def of(self, request: web.Request) -> str:
        """The peer's address; when the peer is a trusted proxy, the right-most
        ``X-Forwarded-For`` hop that is not one (hops to its left are whatever the
        client wrote, and are never read)."""
        peer = request.remote or "unknown"
        if not self._trusted or not self._is_proxy(peer):
            return peer
        hops = [
            hop.strip()
            for header in request.headers.getall("X-Forwarded-For", [])
            for hop in header.split(",")
            if hop.strip()
        ]
        for hop in reversed(hops):
            if not self._is_proxy(hop):
                return hop[:64]  # (a key in the login guard's bounded memory)
        return hops[0][:64] if hops else peer
