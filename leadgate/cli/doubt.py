"""A ``leadgate`` command whose write's ``COMMIT`` is in doubt (PostgreSQL: the
connection dropped with the ``COMMIT`` sent, so it may have landed).

Every command's database settles the doubt itself
(:attr:`leadgate.database.db.Database.settle_doubt`): it asks the server whether the
transaction committed and ends as that one did (committed: the command goes on and
prints its result, one WARNING line on stderr; rolled back: exit 2, "nothing was
stored"). What reaches the command line in doubt is a write the server could not say
about (still away): :class:`WriteInDoubt`, exit :data:`IN_DOUBT_EXIT`, whose message
says, per command (:data:`LOOKS`), which command tells whether it was made, naming the
id the write gave its row (:class:`MintedIds`), or that running it again is safe.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from leadgate.core.clock import IdFactory
from leadgate.core.errors import Unavailable

#: The exit status of a command that could not tell whether its write was made, where
#: exit 2 ("refused") would let a script run it again blindly: the rule
#: :data:`WRITE_IN_DOUBT_RULE`; the message names what to look at.
IN_DOUBT_EXIT = 3
#: The rule of :class:`WriteInDoubt`.
WRITE_IN_DOUBT_RULE = "cli.in_doubt"


class MintedIds:
    """An :class:`IdFactory` that keeps the first id it made of each prefix: the id a
    create gave its row (made in this process, before the insert), for the message of a
    write in doubt to name."""

    def __init__(self, ids: IdFactory) -> None:
        self._ids = ids
        #: prefix -> the first id made with it
        self.minted: dict[str, str] = {}

    def new(self, prefix: str) -> str:
        """A new id of ``ids``, kept when it is the first of ``prefix``."""
        made = self._ids.new(prefix)
        self.minted.setdefault(prefix, made)
        return made


@dataclass(frozen=True)
class Look:
    """How an operator tells whether a command's write in doubt was made: run
    ``leadgate show`` and see whether ``made`` holds (``then``: what to do if it
    does); or, with ``again`` instead, why running the command again is safe. Each text
    is a format string over the command's arguments and, as ``new_<prefix>``, the ids
    the command made (``new_key``)."""

    show: str = ""
    made: str = ""
    then: str = ""
    again: str = ""


_SECRET_LOST = (
    " (its secret was never shown: revoke it, `leadgate key revoke --org {org} {new_key}`, "
    "and create another)"
)

#: Per writing command, how to tell whether its write in doubt was made.
LOOKS: dict[tuple[str, str | None], Look] = {
    ("org", "create"): Look(
        "org list",
        "{name} is listed",
        " (its Owner key's secret was never shown: revoke it, `leadgate key revoke --org "
        "{name} {new_key}`, and make another with `leadgate key create`)",
    ),
    ("key", "create"): Look("key list --org {org}", "key {new_key} is listed", _SECRET_LOST),
    ("key", "revoke"): Look(again="a revoked key is refused [key.revoked], changing nothing"),
    ("user", "create"): Look(again="a user made already is refused [user.email_taken]"),
    ("user", "update"): Look(again="it sets the same values again"),
    ("user", "link"): Look(again="a link made already is refused [link.taken]"),
    ("user", "unlink"): Look(again="a link gone already is refused, changing nothing"),
    ("agent", "create"): Look(again="an agent made already is refused [agent.name_taken]"),
    ("agent", "update"): Look(
        again="it sets the same values again (an agent deleted already is refused "
        "[agent.not_found])"
    ),
    ("preset", "create"): Look(again="a preset made already is refused [preset.name_taken]"),
    ("policy", "add"): Look("policy list --org {org}", "rule {new_pol} is listed"),
    ("policy", "remove"): Look(again="a rule removed already is refused, changing nothing"),
    ("route", "add"): Look("route list --org {org}", "route {new_rte} is listed"),
    ("route", "disable"): Look(again="a disabled route stays disabled"),
    ("schedule", "add"): Look("schedule list --org {org}", "schedule {new_sch} is listed"),
    ("schedule", "remove"): Look(again="a schedule removed already is refused, changing nothing"),
    ("flow", "create"): Look(again="a flow made already is refused [flow.name_taken]"),
    ("flow", "run"): Look(
        "flow show --org {org} {new_run}",
        "run {new_run} is shown",
        " and runs (a worker's flow recovery continues it within 2 minutes of its start: "
        "do not start the flow again, it would run twice)",
    ),
    ("notify", "add"): Look("notify list --org {org}", "destination {new_rdst} is listed"),
    ("notify", "remove"): Look(again="a destination removed already is refused, changing nothing"),
    ("notify", "sla"): Look(again="it sets the same values again"),
    **{
        ("review", action): Look(
            again="an item decided already is refused [workItem.status], naming the "
            "decision, changing nothing"
        )
        for action in ("approve", "reject", "return", "cancel")
    },
    **{
        ("delivery", action): Look(
            again="a delivery recovered already is refused, naming what became of it, "
            "changing nothing"
        )
        for action in ("confirm", "retry")
    },
}

#: ``demo``: idempotent, but a key it made in doubt stays valid with its secret unshown.
DEMO_KEY_LOST = Look(
    "key list --org {name}",
    "key {new_key} is listed",
    " (its secret was never shown: revoke it, `leadgate key revoke --org {name} {new_key}`, "
    "and run the command again)",
)


class WriteInDoubt(Unavailable):
    """A command's write met a database fault at its ``COMMIT`` and the server could
    not say whether it committed: the change may have been made. No retry is asked for
    (run blindly, ``key create`` makes a second key); the message says how to tell."""

    retry_after_s: int | None = None

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message, rule=WRITE_IN_DOUBT_RULE)
        self.detail = detail


def write_in_doubt(
    fault: Unavailable, args: argparse.Namespace, minted: dict[str, str]
) -> WriteInDoubt:
    """:class:`WriteInDoubt` for ``fault`` (in doubt), met by the command of ``args``
    after it made the ids ``minted``."""
    command = (args.command, getattr(args, f"{args.command}_command", None))
    look = LOOKS.get(command, Look())
    if command == ("demo", None):
        look = DEMO_KEY_LOST if "key" in minted else Look(again="it is idempotent")
    fields = {**vars(args), **{f"new_{prefix}": made for prefix, made in minted.items()}}
    said = (
        "the change may have been made: the database connection was lost as it committed, "
        "and the database could not say whether it had"
    )
    if look.again:
        tell = f"running the command again is safe once the database is back: {look.again}"
    elif look.show:
        tell = (
            f"`leadgate {look.show}` tells: if {look.made}, it was made{look.then}; if not, "
            "it was not: run the command again"
        )
    else:
        tell = "look (list or show) before running the command again"
    return WriteInDoubt(f"{said}; {tell.format(**fields)}", fault.detail)
