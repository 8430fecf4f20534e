"""The engine's exception tree.

::

    LeadgateError                 root of everything the engine raises on purpose
    ├── ConfigError               bad or unknown configuration key (startup)
    ├── NotMigratedError          database schema is not at the newest revision
    ├── DatabaseDamaged (500)     the database is damaged: operators must repair it
    ├── ValidationError (400)     input broke a rule; ``rule`` names it
    ├── AuthError (401)           missing or unknown credentials
    ├── PermissionDenied (403)    authenticated, but the scope/role is missing
    ├── NotFound (404)            no such thing in *this* organization
    ├── Conflict (409)            the thing exists but is in the wrong state
    │   └── TransitionError       a fenced work-item update matched no row
    ├── PayloadTooLarge (413)     the request body is over the size limit
    ├── RequestTimeout (408)      the request body did not arrive in time
    ├── RateLimited (429)         too many attempts; ``retry_after_s`` says when to retry
    ├── ModelError (502)          the model provider failed during a turn
    └── Unavailable (503)         the database is busy past its bound, full or unreachable:
        │                         nothing of the request was stored; retry later (in
        │                         doubt: its COMMIT may have landed, and it says so)
        └── TurnInterrupted       the same fault after a turn's message was taken in:
                                  stored once; do NOT send it again (no retry asked for)

Every error that reaches a user carries ``rule``: a short, stable name of the rule that
was broken (for example ``lead.self``), and a human message that says what to do.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import ClassVar

from leadgate.core.logs import loggable

#: How many characters of a client-sent name or id an error message quotes.
QUOTE_LIMIT = 80


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``value`` quoted for an error message, as ``repr`` quotes it (control characters
    escaped), but at most its first ``limit`` characters followed by an ellipsis and the
    full length: a name or id a client sent is echoed in refusals, and 5,000 characters
    sent must not come back whole (every surface builds its refusals from these)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text):,} characters)"


class LeadgateError(Exception):
    """Root of every error the engine raises on purpose."""

    status: int = 500
    code: str = "internal_error"
    #: seconds a client should wait before trying again (a ``Retry-After`` header)
    retry_after_s: int | None = None

    def __init__(
        self, message: str, *, rule: str | None = None, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.rule = rule or self.code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, str]:
        """Public JSON shape of the error (no internals, no secrets)."""
        return {"message": self.message, "rule": self.rule, "code": self.code}


class ConfigError(LeadgateError):
    """The configuration file or an environment override is invalid.

    ``rule`` is required and dotted (``config.toml``, ``database.url``...): without one
    the rule was the code, ``config_error``, and scripts met two spellings for one kind
    of mistake."""

    code = "config_error"

    def __init__(self, message: str, *, rule: str) -> None:
        super().__init__(message, rule=rule)


class NotMigratedError(LeadgateError):
    """The database is not at the newest schema revision."""

    code = "not_migrated"


class DatabaseDamaged(LeadgateError):
    """The service's database is damaged, met while it runs: its SQLite file (``database
    disk image is malformed``, or no longer a database at all), or PostgreSQL reporting
    damaged data or a damaged index (SQLSTATE ``XX001``, ``XX002``). Not the client's
    fault and not transient: only restoring the file (or the data, or rebuilding the
    index) ends it, so clients are told not to retry.

    ``message`` is what clients get (no file path, no server text); ``detail`` names the
    file or the database (never its credentials), what the server said and what to do,
    for the log and the command line."""

    status = 500
    code = "database_damaged"

    def __init__(self, detail: str) -> None:
        super().__init__(
            "the service's database is damaged and cannot answer this request: its "
            "operators must restore it from a backup (retrying will not help)",
            rule="database.file",
        )
        self.detail = detail


class ValidationError(LeadgateError):
    """Input broke a documented rule."""

    status = 400
    code = "invalid_request"


class AuthError(LeadgateError):
    """Missing or unknown credentials."""

    status = 401
    code = "unauthorized"


class PermissionDenied(LeadgateError):
    """The caller is authenticated but lacks the scope or role."""

    status = 403
    code = "forbidden"


class NotFound(LeadgateError):
    """Nothing by that id or name in the caller's organization."""

    status = 404
    code = "not_found"


class Conflict(LeadgateError):
    """The target exists but is in a state that does not allow the action."""

    status = 409
    code = "conflict"


class TransitionError(Conflict):
    """A fenced work-item or delivery update matched no row."""

    code = "invalid_transition"


class ModelError(LeadgateError):
    """The model provider failed while producing a turn.

    ``detail`` is the provider's own words (its error message), shown to the caller after
    ``message`` but never logged: a server may echo the request, message text included.
    :attr:`summary` is what logs get.
    """

    status = 502
    code = "model_error"

    def __init__(
        self,
        message: str,
        *,
        rule: str | None = None,
        retry_after_s: int | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(message + detail, rule=rule, retry_after_s=retry_after_s)
        self.summary = message


class PayloadTooLarge(LeadgateError):
    """The request body is larger than ``[server] max_body_bytes``."""

    status = 413
    code = "request_too_large"


class RequestTimeout(LeadgateError):
    """The client did not send its request body within the server's body timeout."""

    status = 408
    code = "request_timeout"


class RateLimited(LeadgateError):
    """Too many attempts in a window (console logins); retry after ``retry_after_s``."""

    status = 429
    code = "rate_limited"


class Unavailable(LeadgateError):
    """The database cannot take the request now (busy past the bound, disk full,
    unreachable or restarting). The request's transaction rolled back: nothing of it was
    stored. Retrying after ``retry_after_s`` is safe. Unless :attr:`in_doubt`: the fault
    met its COMMIT, which may have landed."""

    status = 503
    code = "unavailable"
    retry_after_s: int | None = 2
    #: what the database said (for the log; never sent to clients)
    detail: str = ""
    _in_doubt = False

    @property
    def in_doubt(self) -> bool:
        """The write failed at or after its COMMIT (PostgreSQL: the connection dropped
        with the COMMIT sent, or under a statement run alone), so it may have landed all
        the same: what is fenced on it must not be undone as if nothing was stored.

        Setting it makes the stock message true: :data:`NOTHING_STORED` becomes
        :data:`MAY_BE_STORED` (and back), so that no surface, log line or peer that
        shows the message has to remember to translate it."""
        return self._in_doubt

    @in_doubt.setter
    def in_doubt(self, value: bool) -> None:
        self._in_doubt = value
        said = {NOTHING_STORED: MAY_BE_STORED} if value else {MAY_BE_STORED: NOTHING_STORED}
        self._say(said.get(self.message, self.message))

    def found_nothing(self) -> Unavailable:
        """This fault, in doubt, once a read-back on a fresh connection found nothing of
        its write (the intake's user message): :data:`NOTHING_STORED` is true again and
        is what it says. :attr:`in_doubt` stays, for what is fenced on it (an
        Idempotency-Key's claim lapses rather than being given back)."""
        if self.message == MAY_BE_STORED:
            self._say(NOTHING_STORED)
        return self

    def _say(self, message: str) -> None:
        self.message = message
        self.args = (message,)  # (str() of the error, as logs and tracebacks show it)


#: ``service.unavailable``'s message where the request may have written: its transaction
#: rolled back.
NOTHING_STORED = (
    "the service cannot store this request right now; nothing was stored, please retry shortly"
)
#: ``service.unavailable``'s message where the fault met the write's COMMIT
#: (:attr:`Unavailable.in_doubt`): it may have landed, so "nothing was stored" may be
#: false.
MAY_BE_STORED = (
    "the database became unavailable as this request was being stored: it may have been "
    "stored all the same, so check whether it was before sending it again"
)
#: ``service.unavailable``'s message where the request only reads (a GET, an MCP resource
#: read or listing): "nothing was stored" answered a question nobody asked.
CANNOT_READ = "the database is unavailable right now; please retry shortly"


def when_reading(exc: Unavailable) -> Unavailable:
    """``exc`` as a request that only reads is told it: a database fault
    (``service.unavailable``) says :data:`CANNOT_READ` (same rule, wait and detail); any
    other 503 (overload, ``turn.interrupted``) is returned as it is."""
    if exc.rule != "service.unavailable" or exc.message == CANNOT_READ:
        return exc
    reading = Unavailable(CANNOT_READ, rule=exc.rule, retry_after_s=exc.retry_after_s)
    reading.detail = exc.detail
    return reading


class TurnInterrupted(Unavailable):
    """A database fault after a turn's message was taken in (committed): the message is
    stored, the turn could not finish. Unlike its parent this is no "nothing was stored,
    retry": sending the message again would take it in twice, so no retry is asked for
    (``retry_after_s`` is ``None``; the web layer adds ``x-should-retry: false``, which
    the official OpenAI clients obey). Raised by the turn path once for every surface
    (REST, MCP, Studio) instead of each deciding it."""

    retry_after_s: int | None = None

    def __init__(self, detail: str = "") -> None:
        super().__init__(
            "the message was taken in, but its turn could not finish: the database is "
            "unavailable. Do not send it again (it would be sent twice); its answer, if "
            "any, will be in the session transcript",
            rule="turn.interrupted",
        )
        self.detail = detail


class IntakeInDoubt(Unavailable):
    """A message's intake failed at its COMMIT (PostgreSQL: the connection dropped with
    it sent, so it may have landed), and reading back whether it did failed too: the
    message may have been taken in. Neither "nothing was stored, retry" nor "taken in":
    no retry is asked for (``retry_after_s`` ``None``, so ``x-should-retry: false``), a
    blind one could take it in twice. ``in_doubt``: an Idempotency-Key's claim is kept
    (lapsed), so a retry with the key is safe. Raised by the intake for every surface."""

    retry_after_s: int | None = None
    #: The message the intake wrote, when it recorded no run (a plain turn's): the turn
    #: path owes its turn, in case it landed (``TurnService.owed``).
    message_id: str | None = None
    #: Its worker's id (with ``message_id``): the owed run's look reads the session's
    #: last event by it and the session key (``leadgate.turns.runs.record_owed``).
    agent_id: str | None = None

    #: Where each surface's client looks for the message, and (REST) the retry that is
    #: safe: MCP and Studio have no Idempotency-Key, so REST's text was untrue for them.
    WHERE: ClassVar[Mapping[str, str]] = {
        "rest": "look for it in the session transcript and send it only if it is not there "
        "(a retry with the same Idempotency-Key is safe)",
        "mcp": "read the session's transcript (the resource "
        "leadgate://agents/{agent}/sessions/{session}/messages) and send it only if it is "
        "not there",
        "studio": "reload the page, look for it in the transcript and send it only if it "
        "is not there",
    }

    def __init__(self, detail: str = "", *, surface: str = "rest") -> None:
        super().__init__(
            "the database became unavailable while this message was being taken in, so it "
            "may have been taken in. Do not send it again blindly (it could be taken in "
            f"twice): once the service is back, {self.WHERE[surface]}",
            rule="intake.in_doubt",
        )
        self.detail = detail
        self.in_doubt = True

    def told_to(self, surface: str) -> IntakeInDoubt:
        """The same error as told to ``surface``'s client (``mcp``, ``studio``)."""
        return IntakeInDoubt(self.detail, surface=surface)


def log_failure(logger: logging.Logger, exc: BaseException, message: str, *args: object) -> None:
    """Log ``exc``, met by work that has no caller to answer (a background task, a
    runner's pass), as ``message % args``.

    A database fault (:class:`Unavailable`, :class:`DatabaseDamaged`) is the database's
    state, already said where it is met (its rule, ``/healthz``), not a bug here: one
    WARNING naming the rule, without the driver's traceback (which may quote what a
    person sent). Anything else is a bug: ERROR with its traceback (a database error's
    without its text: :func:`~leadgate.core.logs.loggable`)."""
    if isinstance(exc, Unavailable | DatabaseDamaged):
        logger.warning(f"{message}: database fault (%s)", *args, exc.rule, stacklevel=2)
    else:
        logger.error(message, *args, exc_info=loggable(exc), stacklevel=2)
