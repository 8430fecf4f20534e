"""How the ``leadgate`` command prints results: JSON (the default, for scripts) or, with
``--format table``, aligned text columns for people."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from leadgate.core.errors import ValidationError

#: Columns of ``--format table`` for list results, by command.
COLUMNS: dict[tuple[str, str | None], list[str]] = {
    ("review", "list"): [
        "id",
        "agent",
        "channel",
        "requester",
        "reason",
        "roundsUsed",
        "waitingSince",
        "preview",
    ],
    ("key", "list"): ["id", "name", "scopes", "active", "createdAt", "revokedAt"],
    ("org", "list"): ["id", "name", "createdAt"],
    ("agent", "list"): ["id", "name", "model", "active", "leadName", "presetId", "updatedAt"],
    ("delivery", "list"): ["id", "kind", "channel", "to", "workItemId", "since", "error"],
    ("schedule", "list"): ["id", "agent", "cron", "active", "nextFireAt", "message"],
    ("policy", "list"): ["id", "position", "action", "pattern"],
    ("user", "list"): ["email", "name", "role", "disabled", "sessions", "createdAt"],
    ("route", "list"): ["id", "agent", "channel", "match", "silent", "active"],
    ("notify", "list"): ["id", "channel", "to", "tier", "agent", "createdAt"],
}
CELL_MAX = 60


#: The rule of a command run with its standard output closed (``>&-``).
STDOUT_RULE = "cli.stdout"


def check_stdout() -> None:
    """Refuse to run with standard output closed (``leadgate key create ... >&-``,
    ``leadgate --version >&-``): the command ran and its result, a new key's secret
    shown once, went nowhere (and the flush after it said ``AttributeError`` as an
    internal error); the version was printed nowhere, exit 0."""
    if sys.stdout is None:
        raise ValidationError(
            "standard output is closed: the command's result would be lost; run it with "
            "its output going to a terminal, a file or a pipe",
            rule=STDOUT_RULE,
        )


def say(line: str = "") -> None:
    """Print ``line`` on standard error, or nowhere when it is closed (``2>&-``): Python
    then has no ``sys.stderr``, and ``print(file=None)`` prints on standard output, where
    an error line was mixed into the data a script parses (the exit code still tells)."""
    if sys.stderr is not None:
        print(line, file=sys.stderr)


def _cell(value: Any, limit: int | None = CELL_MAX) -> str:
    """``value`` on one line; cut to ``limit`` characters (a column of a list), or whole
    (``None``: one result's fields, among them secrets shown once, such as a new API
    key, which a cut would lose for good)."""
    if value is None:
        return "-"
    if isinstance(value, dict):
        value = value.get("name") or value.get("id") or json.dumps(value)
    if isinstance(value, list):
        value = ",".join(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)
    text = " ".join(str(value).split())
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """Rows as aligned columns (``columns``: which keys, default: every scalar key)."""
    if not rows:
        return "(none)"
    cols = columns or [k for k, v in rows[0].items() if not isinstance(v, dict | list)]
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _pairs(data: dict[str, Any], keys: list[str]) -> str:
    width = max(len(k) for k in keys)
    return "\n".join(f"{k.ljust(width)}  {_cell(data.get(k), None)}" for k in keys if k in data)


def _detail(d: dict[str, Any]) -> str:
    head = _pairs(
        d,
        [
            "id",
            "status",
            "agent",
            "channel",
            "requester",
            "reason",
            "revision",
            "roundsAllowed",
            "completionPolicy",
            "createdAt",
            "updatedAt",
        ],
    )
    dest = d.get("destination") or {}
    parts = [head]
    done = d.get("delivery")
    if isinstance(done, dict):
        # A recovery's answer: what became of the delivery acted on, first (a Retry may
        # end a review card ``cancelled``, its item decided; not the item's status).
        said = f"\nDelivery {done.get('id')} ({done.get('kind')}): {done.get('status')}"
        parts.append(said + (f": {done['error']}" if done.get("error") else ""))
    parts += [
        f"\nApproval goes to: {dest.get('description', '-')}",
        f"\nSummary:\n{d.get('summary') or '(none)'}",
        f"\nSnapshot:\n{d.get('snapshot') or '(none)'}",
        f"\nTask context:\n{d.get('taskContext') or '(none)'}",
        "\nVerdicts:\n"
        + table(d.get("reviews", []), ["revision", "by", "actorName", "verdict", "feedback", "at"])
        + _cut_note(d.get("reviewsTruncated"), "verdicts"),
        "\nDeliveries:\n"
        + table(
            # Where each goes in words and when (the channel alone named no conversation).
            d.get("deliveries", []),
            ["id", "to", "action", "status", "attempts", "updatedAt", "nextAttemptAt", "error"],
        )
        + _cut_note(
            d.get("deliveriesTruncated"),
            "deliveries, and those still pending, sending or uncertain,",
        )
        + (
            "\n(More deliveries are still pending, sending or uncertain than are shown (the "
            "oldest of them are); `leadgate delivery list` lists every uncertain one.)"
            if d.get("unsettledDeliveriesTruncated")
            else ""
        ),
        "\nAudit:\n"
        + table(d.get("audit", []), ["at", "actorName", "surface", "action", "from", "to", "text"])
        + _cut_note(d.get("auditTruncated"), "audit entries"),
    ]
    return "\n".join(parts)


def _cut_note(cut: Any, what: str) -> str:
    """The detail's lists are each capped (the console says so under each list too)."""
    return f"\n(Only the newest {what} are shown; older ones exist.)" if cut is True else ""


def _destinations(d: dict[str, Any], columns: list[str] | None) -> str:
    """``notify list``: the destinations, then the timers (override and effective)."""
    sla = d.get("sla") or {}
    override, effective = sla.get("override") or {}, sla.get("effective") or {}
    timers = [
        {"timer": name, "override": override.get(name), "effective": effective.get(name)}
        for name in dict.fromkeys([*override, *effective])
    ]
    return "\n".join(
        [
            table(d["destinations"], columns),
            "\nReview timers:",
            table(timers, ["timer", "override", "effective"]),
        ]
    )


#: What a terminal would act on rather than show: C0 controls but tab and line break, DEL,
#: C1 controls (CSI, OSC) and the bidirectional overrides and isolates. Work item texts
#: come from whoever messaged the worker (and its model): printed raw, an escape sequence
#: could hide text, erase a line or set the window title while an operator reviews it.
_TERMINAL_CONTROLS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def _visible(text: str) -> str:
    """``text`` with every terminal control shown as its escape (``\\x1b``, ``\\u202e``)."""
    return _TERMINAL_CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode(), text)


def one_line(text: str) -> str:
    """``text`` as one line of a terminal: its controls, line breaks among them, shown as
    their escapes. An error line quotes what the operator gave (an id pasted from a chat
    message): a line break in it split the error in two, whose last line scripts read
    for the ``[rule]``, and an escape sequence acted on the terminal."""
    return _visible(text).replace("\n", "\\n")


def render(result: Any, fmt: str, command: tuple[str, str | None]) -> str:
    """``result`` as ``fmt`` (``json``, whose escapes keep every control character
    inert, or ``table``, with them shown escaped)."""
    if fmt == "json":
        return json.dumps(result, default=str)
    return _visible(_table(result, command))


def _table(result: Any, command: tuple[str, str | None]) -> str:
    columns = COLUMNS.get(command)
    if isinstance(result, list):
        return table(result, columns)
    if isinstance(result, dict) and "audit" in result and "deliveries" in result:
        return _detail(result)
    # A page: the queue's items, or (delivery list) the uncertain deliveries.
    listed = [k for k in ("items", "deliveries") if isinstance(result, dict) and k in result]
    if listed and isinstance(result[listed[0]], list):
        lines = [table(result[listed[0]], columns)]
        if "total" in result:
            lines.append(f"\n{result['total']} item(s)")
        if result.get("next"):
            # A cursor is a place in one filtered list: with other filters (or none) the
            # next page is of another list (the hint named the cursor only).
            lines.append(
                f"more: run the same command again, with the same --org and filters, "
                f"adding --cursor {result['next']}"
            )
        return "\n".join(lines)
    if isinstance(result, dict) and isinstance(result.get("destinations"), list):
        return _destinations(result, columns)
    if isinstance(result, dict):
        return _pairs(result, list(result))
    return str(result)
