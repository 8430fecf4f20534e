"""What a database fault in doubt says (``Unavailable.in_doubt``: the fault met the
write's COMMIT, which may have landed). It said "nothing was stored, please retry
shortly" wherever a surface did not translate it (a channel endpoint's 503, the web
layer's 503 to a write, log lines quoting the error); now the error itself says it may
have been stored, and a read-back that found nothing makes it say nothing was."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from bots.base import error_answer
from leadgate.core.errors import (
    MAY_BE_STORED,
    NOTHING_STORED,
    IntakeInDoubt,
    TurnInterrupted,
    Unavailable,
)
from leadgate.database.faults import unavailable
from leadgate.web.common import error_middleware


def lost_at_commit() -> Unavailable:
    """The fault ``leadgate.database.db`` raises for a COMMIT whose answer was lost."""
    fault = unavailable(ConnectionResetError("connection reset by peer"))
    assert fault is not None and fault.message == NOTHING_STORED
    fault.in_doubt = True
    return fault


def test_a_fault_in_doubt_says_it_may_have_been_stored() -> None:
    fault = lost_at_commit()
    assert fault.message == MAY_BE_STORED and str(fault) == MAY_BE_STORED
    assert "nothing was stored" not in repr(fault)
    assert fault.to_dict()["message"] == MAY_BE_STORED
    assert (fault.rule, fault.retry_after_s) == ("service.unavailable", 2)
    fault.in_doubt = False  # (not in doubt after all: it says so again)
    assert fault.message == NOTHING_STORED and str(fault) == NOTHING_STORED


def test_a_read_back_that_found_nothing_says_nothing_was_stored() -> None:
    """The intake's read-back (``Intake._landed``): no message, so nothing was stored;
    the fault stays in doubt for what is fenced on it (a key's claim lapses)."""
    fault = lost_at_commit().found_nothing()
    assert fault.message == NOTHING_STORED and str(fault) == NOTHING_STORED
    assert fault.in_doubt


@pytest.mark.parametrize("fault", [TurnInterrupted("x"), IntakeInDoubt("x")])
def test_faults_with_words_of_their_own_keep_them(fault: Unavailable) -> None:
    said = fault.message
    fault.in_doubt = True
    assert fault.message == said and "nothing was stored" not in said
    assert fault.found_nothing().message == said


async def test_a_channel_endpoint_and_a_write_are_told_it_may_have_been_stored() -> None:
    """A channel endpoint's JSON answer (:func:`bots.base.error_answer`, a Slack
    event's 503 say) and the web layer's 503 to a write (POST) carry the error's
    message: neither translates a fault in doubt."""
    answered = error_answer(lost_at_commit())
    assert answered.status == 503 and answered.text is not None
    assert MAY_BE_STORED in answered.text and "nothing was stored" not in answered.text

    async def decide(request: web.Request) -> web.Response:
        raise lost_at_commit()

    app = web.Application(middlewares=[error_middleware])
    app.router.add_post("/decide", decide)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/decide")
        assert response.status == 503
        error = (await response.json())["error"]
        assert (error["message"], error["rule"]) == (MAY_BE_STORED, "service.unavailable")
