"""``--format table`` output: texts that came from requesters and models are shown, never
acted on by the operator's terminal."""

from __future__ import annotations

import json

import pytest

from leadgate.cli.output import render

# Hide text, set the window title, erase the line and return; a CSI as a C1 control; a
# right-to-left override that reorders what follows.
HOSTILE = "ok\x1b[8mHIDDEN\x1b[0m \x1b]0;pwned\x07 \x1b[2K\r done \x9b2J \u202eevil"


def test_table_output_shows_terminal_controls_as_escapes() -> None:
    detail = {
        "id": "wi_1",
        "status": "awaitingHuman",
        "summary": HOSTILE,
        "snapshot": f"line one\n{HOSTILE}\n\tindented",
        "taskContext": HOSTILE,
        "audit": [{"at": "now", "text": HOSTILE}],
        "deliveries": [],
    }
    listed = {"items": [{"id": "wi_1", "preview": HOSTILE}], "total": 1}
    for text in (
        render(detail, "table", ("review", "show")),
        render(listed, "table", ("review", "list")),
        render({"name": HOSTILE}, "table", ("agent", "show")),
    ):
        assert not any(c in text for c in "\x1b\x07\r\x9b\u202e"), text
        assert "\\x1b[8mHIDDEN" in text and "\\u202eevil" in text
    shown = render(detail, "table", ("review", "show"))
    assert "line one\n" in shown and "\n\tindented" in shown  # line breaks and tabs stay


def test_json_output_keeps_every_control_escaped() -> None:
    out = render({"summary": HOSTILE}, "json", ("review", "show"))
    assert not any(c in out for c in "\x1b\x07\r\x9b\u202e")
    assert json.loads(out)["summary"] == HOSTILE


def test_nested_values_in_a_table_cell_are_json_not_python_reprs() -> None:
    # (flow create --format table printed its nodes as Python dicts)
    text = render({"nodes": [{"id": "a", "next": None}]}, "table", ("flow", "create"))
    assert '{"id": "a", "next": null}' in text and "'id'" not in text


def test_one_result_s_fields_are_printed_whole() -> None:
    """A new API key is shown once: ``--format table`` cut it at 60 characters, and the
    key could not be had again (nor the organization made again: its name was taken)."""
    key = "lg.key_18ee757273201afc06cd905836." + "C" * 43
    out = render({"id": "org_1", "apiKey": key}, "table", ("org", "create"))
    assert key in out.splitlines()[1]
    listed = render([{"id": "x", "note": "n" * 100}], "table", ("thing", "list"))
    assert "n" * 100 not in listed and "…" in listed  # a list's columns are still cut


def test_the_paging_hint_says_to_repeat_the_same_filters() -> None:
    """A cursor is a place in one filtered list; the hint named the cursor only, and an
    operator who left the filters out got the next page of another list."""
    for key, command in (("items", ("review", "list")), ("deliveries", ("delivery", "list"))):
        text = render({key: [{"id": "x_1"}], "next": "c_2"}, "table", command)
        last = text.splitlines()[-1]
        assert "same --org and filters" in last and last.endswith("--cursor c_2"), last


def test_review_show_says_where_each_delivery_goes_and_when() -> None:
    """``review show --format table`` listed a delivery's channel only."""
    delivery = {
        "id": "dlv_1",
        "channel": "slack",
        "to": "Slack channel C1 (team T1), thread 1.1",
        "action": "post",
        "status": "deliveryUnknown",
        "attempts": 2,
        "error": "read timeout",
        "updatedAt": "2026-01-02T03:04:05Z",
        "nextAttemptAt": None,
    }
    text = render(
        {"id": "wi_1", "audit": [], "deliveries": [delivery]}, "table", ("review", "show")
    )
    rows = text.split("Deliveries:\n", 1)[1].splitlines()
    assert rows[0].split()[:2] == ["ID", "TO"], rows[0]
    assert "Slack channel C1" in rows[1] and "2026-01-02T03:04:05Z" in rows[1]
    assert "deliveryUnknown" in rows[1] and "read timeout" in rows[1]


def test_review_show_says_under_each_list_when_it_is_cut() -> None:
    """``review show --format table`` listed the newest entries only without saying so."""
    detail = {
        "id": "wi_1",
        "reviews": [],
        "reviewsTruncated": True,
        "audit": [],
        "auditTruncated": True,
        "deliveries": [],
        "deliveriesTruncated": True,
        "unsettledDeliveriesTruncated": True,
    }
    text = render(detail, "table", ("review", "show"))
    verdicts = text.split("Verdicts:\n", 1)[1].split("Deliveries:\n", 1)[0]
    deliveries = text.split("Deliveries:\n", 1)[1].split("Audit:\n", 1)[0]
    audit = text.split("Audit:\n", 1)[1]
    assert "Only the newest verdicts are shown; older ones exist." in verdicts
    assert "those still pending, sending or uncertain, are shown; older" in deliveries
    assert "More deliveries are still pending, sending or uncertain" in deliveries
    assert "Only the newest audit entries are shown; older ones exist." in audit
    whole = render(
        {**detail, **dict.fromkeys(("reviewsTruncated", "auditTruncated"), False)},
        "table",
        ("review", "show"),
    )
    assert "verdicts are shown" not in whole and "audit entries are shown" not in whole


def test_a_recovery_says_what_became_of_its_delivery_first() -> None:
    """``delivery retry --format table`` showed the item's detail only: a review card
    the retry ended ``cancelled`` (its item decided) was a row among the deliveries."""
    done = {"id": "dlv_2", "kind": "card", "status": "cancelled", "error": "its item was decided"}
    detail = {"id": "wi_1", "status": "completed", "audit": [], "deliveries": [], "delivery": done}
    text = render(detail, "table", ("delivery", "retry"))
    head, rest = text.split("\nDelivery dlv_2 (card): cancelled: its item was decided\n", 1)
    assert "completed" in head and "Approval goes to" in rest


def test_version_names_the_release_and_the_schema_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import version

    from alembic.script import ScriptDirectory

    from leadgate.cli.parser import build_parser
    from leadgate.database.db import alembic_config

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])  # no subcommand needed
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"leadgate {version('leadgate')} (schema {head})\n"
