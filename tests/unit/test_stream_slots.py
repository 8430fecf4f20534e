"""StreamSlots: the per-process bound on open event streams (session events, the operator
feed), counted from the check itself."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from leadgate.core.errors import Unavailable
from leadgate.web.common import StreamSlots


def test_a_slot_is_held_for_the_block_and_given_back_however_it_ends() -> None:
    slots = StreamSlots(2)
    request = make_mocked_request("GET", "/v1/agents/a/sessions/s/events")
    with slots.take(request), slots.take(request):
        assert slots.taken == 2
        with pytest.raises(Unavailable) as refused, slots.take(request):
            pass
        assert (refused.value.status, refused.value.rule) == (503, "events.limit")
        assert refused.value.retry_after_s == 5
        assert slots.taken == 2  # a refusal takes nothing
    assert slots.taken == 0
    with pytest.raises(ConnectionResetError), slots.take(request):
        raise ConnectionResetError
    assert slots.taken == 0
