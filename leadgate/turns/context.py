"""What a turn runs under: the trusted context and the ``complete_task`` tool."""

from __future__ import annotations

import json
from dataclasses import dataclass

from leadgate.core.limits import SUMMARY_LIMIT
from leadgate.turns.providers.base import ToolSpec

COMPLETE_TASK = ToolSpec(
    name="complete_task",
    description=(
        "Call this once the task is finished. Your reply is then held for review by your "
        "lead before anyone sees it. Give a short summary of what you did."
    ),
    parameters={
        "type": "object",
        "properties": {
            "summary": {
                "type": "string",
                "description": "What was done, 1 to 2,000 characters.",
                "minLength": 1,
                "maxLength": SUMMARY_LIMIT,
            }
        },
        "required": ["summary"],
        "additionalProperties": False,
    },
)

#: complete_task's tool result when the signal was recorded for this turn.
SUBMITTED = json.dumps({"ok": True, "status": "submitted for lead review"})
#: complete_task's tool result when the turn's item had left inProgress (submitted by
#: another turn of the session, or cancelled): no signal, and the turn is withheld.
ITEM_GONE = json.dumps({"error": "no in-progress work item matches this turn"})


@dataclass(frozen=True)
class TurnContext:
    """Trusted, server-side context of a turn. Never model input."""

    org_id: str
    agent_id: str
    session_id: str
    binding_id: str
    turn_id: str
    work_item_id: str | None = None
    revision: int | None = None
    # False when the turn's binding can never post (api, studio, silent): a plain reply
    # then has nothing to queue, whichever binding is active by the end of the turn.
    binding_posts: bool = True
    # The lease token of the turn's recorded run (leadgate.turns.runs), deleted in the
    # turn's last transaction; ``run_fenced``: a lost lease rolls that transaction back.
    run_token: str | None = None
    run_fenced: bool = False
    # How many runs ``run_token`` leases (a recovery claim's of one session: its
    # run_ids), all deleted by that transaction when fenced, or it rolls back.
    run_count: int = 1
    # A REST/MCP/Studio turn run by turn recovery (its client was told not to send the
    # message again): no client waits for its answer, so a failure ends its work item.
    recovered_client: bool = False
    # ... whose client was told nothing was stored (its intake in doubt) and resends it
    # under its Idempotency-Key, a duplicate that runs no turn (runs.Claimed.keyed_resend):
    # a failure's audit says so.
    keyed_resend: bool = False
    # The external event ids its runs' messages were taken in under (a rerun's): REST's
    # Idempotency-Key events among them get the rerun's answer, or its failure, stored
    # under their key in the transaction that ends the run.
    keyed_events: tuple[str, ...] = ()
    # The id of the user message its intake stored (None for a recovered run's turn): a
    # plain REST/MCP/Studio turn, which records no run, stopped on a database fault is
    # recorded as one by it once the database is back (TurnService.owed).
    message_id: str | None = None
    # The process that took that message in (its ``messages.taken_by``; None when it
    # records a run, or no process is registered): one reaped while the turn ran (thought
    # dead) had its message recorded by turn recovery (TurnService._take_back).
    taken_by: str | None = None
    # The user message a recovered REST/MCP/Studio run's rerun answers (its newest run's):
    # its answer names it (messages.answers), as a plain turn's names ctx.message_id.
    answers: str | None = None
    # A keyed REST retry's takeover of its message's run (runs.claim_for_retry): the
    # process that took the message in, only thought dead, may still answer it, so the
    # turn's end looks for that answer (runs.end_retaken).
    retaken: bool = False
