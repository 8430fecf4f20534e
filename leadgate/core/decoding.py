"""The one way request bodies and headers are read and decoded, for every surface.

Every HTTP route (REST, agents, operator, console, MCP) and every channel body (Slack,
Discord, Teams) goes through :func:`leadgate.core.bodies.read_body` and
:func:`decode_json` before anything else looks at the bytes; a channel verifies its
signature on the raw bytes first.

* :func:`leadgate.core.bodies.read_body` (a module of its own: it needs aiohttp at
  import, which the CLI's commands do not load) enforces the one body-size limit
  (``[server] max_body_bytes``, the application's ``client_max_size``: 413) and the body
  read timeout (408), so a slow or huge upload can neither stall a handler nor grow
  memory.
* :func:`bearer_token`: the one reading of ``Authorization: Bearer``.
* :func:`query_value` (:func:`single_value` for a query parsed elsewhere, as an MCP
  resource URI's): the one reading of a query parameter, refused when it is given twice.
* :func:`decimal_int`: the one reading of a count, time or id number a client wrote (query
  parameters, ``Last-Event-ID``): ASCII digits only (``str.isdigit`` also passes ``"²"``,
  which ``int`` refuses) and at most :data:`INT64_MAX`, the widest integer both databases
  store (a larger one raised ``OverflowError`` in the driver: a 500).
* :func:`decode_json`: strict UTF-8 (Python's codec refuses encoded surrogates and
  overlong forms), standard JSON only (no ``NaN``/``Infinity``), at most
  :data:`MAX_DEPTH` levels of nesting (checked without recursion; Python's own parser
  raises ``RecursionError`` far deeper), no lone surrogate escapes (``"\\ud800"``: they
  cannot be stored or encoded) and, unless ``allow_nul``, no NUL characters (PostgreSQL
  text cannot hold them). Every failure is a 400 naming the rule.

Hand-written on purpose: the standard library's ``json`` does the parsing; what it lacks
(a depth bound and the surrogate/NUL checks) is one iterative walk here, cheaper than a
second parser as a dependency.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from leadgate.core.errors import ValidationError
from leadgate.core.limits import SURROGATE, UNSTORABLE, cut

if TYPE_CHECKING:
    # Only read here (headers, query): aiohttp itself is loaded by the body reading,
    # leadgate.core.bodies, which the CLI's commands do not import.
    from aiohttp import web

#: Deepest nesting of arrays/objects a body may have (Slack blocks need about 10).
MAX_DEPTH = 64
#: The largest integer SQLite and PostgreSQL (``BIGINT``) hold.
INT64_MAX = 2**63 - 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _OutOfRange(ValueError):
    """A JSON number too large for a float (``1e999``)."""


def _finite_float(text: str) -> float:
    # json.loads makes 1e999 an infinity, which no JSON can hold: written back out it
    # would be ``Infinity``, which json.dumps emits and no client parses.
    value = float(text)
    if math.isinf(value):
        raise _OutOfRange(text)
    return value


def decimal_int(raw: str) -> int | None:
    """``raw`` as a non-negative integer of ASCII digits, at most :data:`INT64_MAX`;
    ``None`` otherwise (the caller answers 400 with its own rule)."""
    # 19 digits hold INT64_MAX; the length test also keeps int() off huge strings.
    if not raw or len(raw) > 19 or not raw.isascii() or not raw.isdigit():
        return None
    value = int(raw)
    return value if value <= INT64_MAX else None


def decode_text(raw: bytes) -> str:
    """``raw`` as strict UTF-8 (400 ``body.utf8`` otherwise)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError("the body is not valid UTF-8", rule="body.utf8") from None


def decode_json(raw: bytes | str, *, allow_nul: bool = False, max_depth: int = MAX_DEPTH) -> Any:
    """Decode a JSON document (see the module docstring for every check)."""
    text = decode_text(raw) if isinstance(raw, bytes) else raw
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except _OutOfRange:
        raise ValidationError(
            "the body holds a number too large to represent", rule="body.number"
        ) from None
    except RecursionError:
        raise ValidationError(
            f"the body is nested deeper than {max_depth} levels", rule="body.depth"
        ) from None
    except ValueError:
        raise ValidationError("the body is not valid JSON", rule="body.json") from None
    if text is raw or "\\u" in text or text.count("{") + text.count("[") > max_depth:
        check_value(value, allow_nul=allow_nul, max_depth=max_depth)
    # Else there is nothing to find in a body decoded from bytes: a lone surrogate or a
    # NUL in its strings can only come from a \u escape (strict UTF-8 has no
    # surrogates, and json.loads refuses raw control characters in strings), and a
    # document with no more brackets than max_depth cannot nest deeper (brackets
    # inside strings only raise the count). A str handed in may hold raw surrogates.
    return value


def check_value(value: Any, *, allow_nul: bool = False, max_depth: int = MAX_DEPTH) -> None:
    """Walk a decoded JSON value without recursion: depth, lone surrogates, NULs."""
    bad = SURROGATE if allow_nul else UNSTORABLE
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii() or not allow_nul:
                _check_text(node, bad)
            continue
        if isinstance(node, dict):
            if depth > max_depth:
                raise ValidationError(
                    f"the body is nested deeper than {max_depth} levels", rule="body.depth"
                )
            for key, child in node.items():
                _check_text(key, bad)
                if isinstance(child, dict | list | str):
                    stack.append((child, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                raise ValidationError(
                    f"the body is nested deeper than {max_depth} levels", rule="body.depth"
                )
            stack.extend(
                (child, depth + 1) for child in node if isinstance(child, dict | list | str)
            )


def _check_text(text: str, bad: re.Pattern[str]) -> None:
    found = bad.search(text)
    if found is None:
        return
    if found.group() == "\x00":
        raise ValidationError("the body contains a NUL character", rule="body.nul")
    raise ValidationError(
        "the body contains a lone UTF-16 surrogate (not a character)", rule="body.surrogate"
    )


def refuse_unknown_fields(
    body: Mapping[str, Any], fields: Collection[str], *, rule: str, what: str = "fields"
) -> None:
    """Refuse a JSON body naming a field its request does not take (400 ``rule``, the
    fields it takes named): ignored, a misspelt one (``"revison"``) went by as if it had
    never been sent. The unknown names are quoted at most 200 characters (a body of a
    thousand made-up names is not echoed whole)."""
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ValidationError(
            f"unknown {what}: {cut(', '.join(unknown), 200)} (this request takes "
            f"{', '.join(sorted(fields))})",
            rule=rule,
        )


def json_object(raw: bytes | str, *, allow_nul: bool = False) -> dict[str, Any]:
    """:func:`decode_json` of a body that must be a JSON object (400 otherwise)."""
    value = decode_json(raw, allow_nul=allow_nul)
    if not isinstance(value, dict):
        raise ValidationError("the body must be a JSON object", rule="body.object")
    return value


def bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme in any case, blanks around
    the token dropped), or ``None``: no header or two, another scheme, no token, or a
    token that is not printable ASCII. Every key and token this service issues is printable ASCII;
    aiohttp hands other header bytes over as surrogate escapes, which no key lookup,
    SQL parameter or encoder downstream should ever see (they raised there: a 500)."""
    values = request.headers.getall("Authorization", [])
    if len(values) != 1:  # none, or two: which one was meant is anybody's guess
        return None
    scheme, _, token = values[0].partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not token.isascii() or not token.isprintable():
        return None
    return token


def single_header(request: web.Request, name: str) -> str | None:
    """The one value of header ``name``, or ``None`` without it; sent twice or more, a
    400 ``header.repeated`` naming it. ``request.headers.get`` took the first of them
    silently: two ``X-Session-Id`` (or ``Idempotency-Key``) headers, each of which a
    client, a proxy or a library may have added, chose one session (or key) of two that
    were meant, unseen."""
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise ValidationError(
            f"the {name} header was sent {len(values)} times: send it once",
            rule="header.repeated",
        )
    return values[0] if values else None


def single_value(name: str, values: Sequence[str]) -> str | None:
    """The one value of query parameter ``name`` among ``values`` (every value the query
    gave it), or ``None`` without one; given twice or more, a 400 ``query.repeated``
    naming it. REST took the first of ``?limit=1&limit=2`` and the MCP resource the
    last: a client could not tell which one counted."""
    if len(values) > 1:
        raise ValidationError(
            f"the query parameter {name} was given {len(values)} times: give it once",
            rule="query.repeated",
        )
    return values[0] if values else None


def query_value(request: web.Request, name: str) -> str | None:
    """The one value of ``request``'s query parameter ``name`` (:func:`single_value`)."""
    return single_value(name, request.query.getall(name, []))


def header_text(request: web.Request, name: str, *, limit: int = 1024) -> str | None:
    """A header holding client text (``X-Session-Id``...): printable ASCII only, sent
    once (:func:`single_header`).

    aiohttp hands non-ASCII header bytes over as surrogate escapes; they and control
    characters are a 400 here instead of an error wherever the value is used later.
    """
    value = single_header(request, name)
    if value is None:
        return None
    if len(value) > limit or not value.isascii() or not value.isprintable():
        raise ValidationError(
            f"the {name} header must be at most {limit} printable ASCII characters",
            rule=f"header.{name.lower()}",
        )
    return value
