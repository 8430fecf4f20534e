"""Bad input never crashes and never writes: clear ValidationErrors naming the rule, and
property tests over arbitrary JSON for the parsers that face the outside world."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import example, given, settings
from hypothesis import strategies as st

from leadgate.core.auth import Principal, Scope
from leadgate.core.errors import ValidationError
from leadgate.core.limits import MESSAGE_LIMIT, validate_message
from leadgate.core.types import BindingKind, BindingSpec, Reply, Trigger
from leadgate.database import schema as t
from leadgate.domain.agents import CompletionPolicy, validate_review_config
from leadgate.domain.policy import REDACTED, compile_rule, screen
from leadgate.operations.sessions import api_session_key
from leadgate.web.openai_api import parse_request
from tests.helpers import api_trigger, make_agent, make_org
from tests.stack import Stack

HYPOTHESIS = settings(max_examples=80, deadline=None)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


# ------------------------------------------------------------------------ messages


BAD_MESSAGES = [
    ("", "message.empty"),
    ("   ", "message.empty"),
    ("\n\t \r\n", "message.empty"),
    ("a" * (MESSAGE_LIMIT + 1), "message.too_long"),
    ("before\x00after", "message.invalid"),
    ("\x00", "message.invalid"),
]


@pytest.mark.parametrize(("text", "rule"), BAD_MESSAGES)
def test_validate_message_names_the_rule(text: str, rule: str) -> None:
    with pytest.raises(ValidationError) as info:
        validate_message(text)
    assert info.value.rule == rule
    assert info.value.status == 400


def test_validate_message_accepts_the_limit() -> None:
    assert validate_message("a" * MESSAGE_LIMIT) == "a" * MESSAGE_LIMIT
    assert validate_message(" x ") == " x "


async def row_counts(stack: Stack) -> dict[str, int]:
    async with stack.db.read() as conn:
        return {
            table.name: int(await conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)
            for table in t.metadata.sorted_tables
        }


async def test_bad_messages_write_nothing_on_any_way_in(stack: Stack) -> None:
    org = await make_org(stack)
    await make_agent(stack, org, "lead")
    worker = await make_agent(stack, org, "worker", lead="lead")
    plain = await make_agent(stack, org, "plain")
    # an existing in-progress item, so that an append would be visible too
    assert await stack.turns.run(api_trigger(org, worker, "start")) == Reply("Echo: start")
    before = await row_counts(stack)
    for agent in (worker, plain):
        for text, rule in BAD_MESSAGES:
            for event_id in (None, f"evt-{rule}-{len(text)}"):
                trigger = Trigger(
                    org_id=org.id,
                    agent_id=agent["id"],
                    session_key="s1",
                    text=text,
                    binding=BindingSpec(BindingKind.slack, {"channel": "C1", "thread_ts": "1"}),
                    external_event_id=event_id,
                )
                with pytest.raises(ValidationError) as info:
                    await stack.turns.run(trigger)
                assert info.value.rule == rule
    assert await row_counts(stack) == before

    # An over-long session key is refused the same way on both backends (it would not
    # fit the sessions table: SQLite would store it, PostgreSQL would fail mid-intake).
    for key in ("", "k" * 501):
        with pytest.raises(ValidationError) as info:
            await stack.turns.run(api_trigger(org, worker, "fine text", session=key))
        assert info.value.rule == "session.length"
    # An inactive worker takes nothing in.
    async with stack.db.tx() as conn:
        await conn.execute(
            t.agents.update().where(t.agents.c.id == plain["id"]).values(active=False)
        )
    before = await row_counts(stack)
    with pytest.raises(ValidationError) as info:
        await stack.turns.run(api_trigger(org, plain, "hello?"))
    assert info.value.rule == "agent.inactive"
    assert await row_counts(stack) == before
    # The longest session key fits.
    assert await stack.turns.run(api_trigger(org, worker, "x", session="k" * 500)) == Reply(
        "Echo: x"
    )
    # the item's task context and binding are untouched; a good message still works
    ok = await stack.turns.run(api_trigger(org, worker, "a" * MESSAGE_LIMIT))
    assert ok == Reply("Echo: " + "a" * MESSAGE_LIMIT)


# ------------------------------------------------------------ leadReviewConfig


def oracle(raw: Any) -> tuple[CompletionPolicy, int] | None:
    """What validate_review_config must answer (None = ValidationError)."""
    if raw is None:
        return CompletionPolicy.requestHumanApproval, 3
    if not isinstance(raw, dict) or set(raw) - {"completionPolicy", "maxRevisionRounds"}:
        return None
    policy = raw.get("completionPolicy", "requestHumanApproval")
    rounds = raw.get("maxRevisionRounds", 3)
    if not isinstance(policy, str) or policy not in {p.value for p in CompletionPolicy}:
        return None
    if type(rounds) is not int or not 1 <= rounds <= 5:
        return None
    return CompletionPolicy(policy), rounds


review_configs = json_values | st.dictionaries(
    st.sampled_from(["completionPolicy", "maxRevisionRounds"]) | st.text(max_size=8),
    json_values
    | st.sampled_from(["completeAutomatically", "requestHumanApproval"])
    | st.integers(min_value=-2, max_value=8),
    max_size=3,
)


@HYPOTHESIS
@given(review_configs)
@example({"maxRevisionRounds": True})
@example({"maxRevisionRounds": 3.0})
@example({"completionPolicy": ["requestHumanApproval"]})
@example({"completionPolicy": {"a": 1}})
@example({"completionPolicy": "completeAutomatically", "maxRevisionRounds": 5})
def test_validate_review_config_never_crashes(raw: Any) -> None:
    expected = oracle(raw)
    try:
        result = validate_review_config(raw)
    except ValidationError as exc:
        assert expected is None, (raw, exc.rule)
        assert exc.rule.startswith("leadReviewConfig.")
        return
    assert result == expected
    policy, rounds = result
    assert isinstance(policy, CompletionPolicy)
    assert type(rounds) is int and 1 <= rounds <= 5


# ------------------------------------------------------------------- policy rules

regex_pieces = st.sampled_from(
    [
        "a",
        "b",
        ".",
        "*",
        "+",
        "?",
        "|",
        "^",
        "$",
        "(",
        ")",
        "[",
        "]",
        "{",
        "}",
        "{2}",
        "{2,1}",
        "{99999999999}",
        "\\",
        "\\d",
        "\\1",
        "(?P<n>",
        "(?P=n)",
        "(?i)",
        "(?<=a)",
        "-",
        ",",
    ]
)
patterns = st.text(max_size=40) | st.lists(regex_pieces, max_size=20).map("".join)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # re warns about odd but valid sets
@HYPOTHESIS
@given(patterns, st.sampled_from(["block", "redact", "Block", "", "drop"]), st.text(max_size=40))
@example("a{4294967296}", "redact", "aaa")
@example("(" * 600 + ")" * 600, "block", "x")
@example("(a*)*", "redact", "aaaa")
def test_compile_rule_is_a_rule_or_a_validation_error(
    pattern: str, action: str, sample: str
) -> None:
    try:
        rule = compile_rule(pattern, action)
    except ValidationError as exc:
        assert exc.rule in {"policy.pattern", "policy.action"}
        return
    assert action in {"block", "redact"}
    assert 1 <= len(pattern) <= 2000
    out = screen(sample, [rule])
    assert isinstance(out, str)
    if rule.pattern.search(sample) is None:
        assert out == sample
    elif action == "redact":
        assert REDACTED in out


# -------------------------------------------------------- OpenAI request bodies

PRINCIPAL = Principal(org_id="org_1", scopes=frozenset({Scope.trigger}), key_id="key_1")

content_values = json_values | st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]) | json_values},
        optional={"text": json_values | st.text(max_size=20)},
    ),
    max_size=3,
)
chat_messages = st.lists(
    json_values
    | st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(["user", "assistant", "system", "tool"]) | json_values,
            "content": content_values,
            "name": json_values,
        },
    ),
    max_size=4,
)
bodies = st.dictionaries(st.text(max_size=10), json_values, max_size=5) | st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=20) | json_values,
        "messages": chat_messages | json_values,
        "stream": st.booleans() | json_values,
        "user": st.text(max_size=250) | json_values,
        "temperature": json_values,
    },
)


@HYPOTHESIS
@given(bodies, st.none() | st.text(max_size=250))
@example({"model": "w", "messages": [{"role": "user", "content": "hi"}]}, None)
@example(
    {"model": "w", "messages": [{"role": "user", "content": [{"type": "text"}]}], "user": 5},
    "",
)
@example({"model": "w", "messages": [{"role": "user"}]}, None)
@example({"model": "w", "messages": [None, {"role": "user", "content": "x"}]}, None)
def test_parse_request_only_raises_validation_errors(
    body: dict[str, Any], header_session: str | None
) -> None:
    try:
        parsed = parse_request(body)
        session = api_session_key(PRINCIPAL, session=header_session, user=parsed.user)
    except ValidationError as exc:
        assert exc.status == 400
        assert exc.rule
        return
    assert isinstance(parsed.model, str) and parsed.model == body["model"]
    assert isinstance(parsed.text, str)
    assert isinstance(parsed.stream, bool)
    assert isinstance(session, str) and len(session) <= 202
    # One namespace: X-Session-Id, else `user`; neither (or "default") is the default.
    name = header_session or (body["user"] if isinstance(body.get("user"), str) else None)
    if name and name != "default":
        assert session == f"h:{name}"
    else:
        assert session == "default:key_1"


@pytest.mark.parametrize("name", ["a\x00b", "tab\there", "\x7f", "x\x85", "\ud800"])
def test_a_public_session_name_with_a_control_character_is_refused(name: str) -> None:
    principal = Principal(org_id="org_1", scopes=frozenset(), key_id="key_1")
    with pytest.raises(ValidationError) as info:
        api_session_key(principal, session=name)
    assert info.value.rule == "session.text"
    with pytest.raises(ValidationError):
        api_session_key(principal, session=None, user=name)  # the REST body's `user` too
    # Any other text is a name: spaces, accents, emoji.
    assert api_session_key(principal, session="Café ☕ 2") == "h:Café ☕ 2"


@pytest.mark.parametrize("text", [{"a": 1}, 5, None, ["x"], True])
def test_a_text_part_whose_text_is_not_a_string_is_refused(text: Any) -> None:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "fine"}, {"type": "text"}]
    parts[1]["text"] = text
    if text is None:
        del parts[1]["text"]  # no text at all is refused the same way
    with pytest.raises(ValidationError) as info:
        parse_request({"model": "w", "messages": [{"role": "user", "content": parts}]})
    assert info.value.rule == "messages.content"
    ok = parse_request({"model": "w", "messages": [{"role": "user", "content": parts[:1] * 2}]})
    assert ok.text == "fine\nfine"


@pytest.mark.parametrize("value", [123, None, ["hi"], {"text": "hi"}])
def test_a_message_that_is_no_string_names_its_type(value: Any) -> None:
    with pytest.raises(ValidationError) as info:
        validate_message(value)
    assert info.value.rule == "message.type"
