"""The 409 bodies a held turn gets, as the SPEC writes them: the seed's 409s, plus the
`param` every OpenAI error envelope carries (null) and the `rule` every error of the
service names. Spelled out here once, for every acceptance test that asserts them."""

from __future__ import annotations

from typing import Any

PENDING = "This turn is pending Lead review. Retry after the review completes."
GATED_BODY: dict[str, Any] = {
    "error": {
        "message": PENDING,
        "type": "lead_review_pending",
        "param": None,
        "code": "LEAD_REVIEW_PENDING",
        "rule": "turn.gated",
        "workItemId": None,
        "revision": None,
    }
}
BUSY_BODY: dict[str, Any] = {
    "error": {
        "message": PENDING,
        "type": "lead_review_pending",
        "param": None,
        "code": "LEAD_REVIEW_PENDING",
        "rule": "turn.busy",
    }
}
