"""Reviewer links: which chat-platform user is which leadgate user (``leadgate user link``).

A platform identity decides in chat only through its link: the linked user's role must
grant ``agent:review`` in the organization of the item (SPEC 13). Identities:

* ``slack``: ``TEAM:USER`` (workspace id and member id, e.g. ``T0123:U0456``)
* ``teams``: the user's Microsoft Entra (AAD) object id (``from.aadObjectId``)
* ``discord``: the user's snowflake id

A reply to an email review card needs no link: the sender's address is the user's own
(``email``, see :func:`reviewer`).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, TypedDict

import sqlalchemy as sa

from leadgate.core.auth import ROLE_SCOPES, Principal, Role
from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.errors import Conflict, NotFound, ValidationError, quoted
from leadgate.database import schema as t
from leadgate.database.db import Conn

L = t.user_links.c
U = t.users.c
PLATFORMS = ("slack", "teams", "discord")

_FORMS = {
    "slack": (re.compile(r"[A-Z0-9]{2,30}:[A-Z0-9]{2,30}"), "TEAM:USER, e.g. T0123ABC:U0456DEF"),
    "teams": (
        re.compile(r"[0-9a-fA-F-]{8,64}"),
        "the user's Entra (AAD) object id, e.g. 00000000-0000-0000-0000-000000000001",
    ),
    "discord": (re.compile(r"\d{5,25}"), "the user's numeric id (a snowflake)"),
}


class Reviewer(NamedTuple):
    """The leadgate user behind a platform identity, in one organization."""

    user_id: str
    email: str
    role: str
    org_id: str

    def principal(self) -> Principal:
        """The principal this reviewer acts as (the role's scopes)."""
        return Principal(
            org_id=self.org_id, scopes=ROLE_SCOPES[Role(self.role)], user_id=self.user_id
        )


def check_identity(platform: str, identity: str) -> str:
    """A platform identity in its documented form (ValidationError naming the form)."""
    if platform not in _FORMS:
        raise ValidationError("platform must be slack, teams or discord", rule="link.platform")
    pattern, form = _FORMS[platform]
    identity = identity.strip()
    if platform == "teams":
        identity = identity.lower()
    if not pattern.fullmatch(identity):
        raise ValidationError(f"a {platform} identity is {form}", rule="link.identity")
    return identity


class LinkView(TypedDict):
    """A linked identity: its user's email and role, and whether that user may review."""

    email: str
    role: str
    platform: str
    identity: str
    canReview: bool


class UnlinkedView(TypedDict):
    """A removed link."""

    email: str
    platform: str
    identity: str
    unlinked: bool


class ListedLinkView(TypedDict):
    """One of the organization's links."""

    email: str
    role: str
    platform: str
    identity: str
    createdAt: str | None


async def link(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    *,
    org_id: str,
    email: str,
    platform: str,
    identity: str,
) -> LinkView:
    """Link ``identity`` on ``platform`` to the user ``email`` of ``org_id``."""
    identity = check_identity(platform, identity)
    user = await _user(conn, org_id, email)
    existing = (
        await conn.execute(
            sa.select(L.user_id).where(
                L.org_id == org_id, L.platform == platform, L.identity == identity
            )
        )
    ).first()
    if existing is not None:
        if existing.user_id == user.id:
            return await _view(conn, org_id, platform, identity)
        raise Conflict(
            f"{platform} identity {quoted(identity)} is already linked to another user; "
            "unlink it first",
            rule="link.taken",
        )
    await conn.execute(
        t.user_links.insert().values(
            id=ids.new("lnk"),
            org_id=org_id,
            user_id=user.id,
            platform=platform,
            identity=identity,
            created_at=clock.now_ms(),
        )
    )
    return await _view(conn, org_id, platform, identity)


async def unlink(
    conn: Conn, *, org_id: str, email: str, platform: str, identity: str
) -> UnlinkedView:
    """Remove one link (NotFound when there is none)."""
    identity = check_identity(platform, identity)
    user = await _user(conn, org_id, email)
    res = await conn.execute(
        t.user_links.delete().where(
            L.org_id == org_id,
            L.user_id == user.id,
            L.platform == platform,
            L.identity == identity,
        )
    )
    if not res.rowcount:
        raise NotFound(
            f"{quoted(email)} has no {platform} link {quoted(identity)}", rule="link.not_found"
        )
    return {"email": user.email, "platform": platform, "identity": identity, "unlinked": True}


async def list_links(conn: Conn, org_id: str) -> list[ListedLinkView]:
    """The organization's links with each user's email and role."""
    rows = (
        await conn.execute(
            sa.select(L.platform, L.identity, L.created_at, U.email, U.role)
            .select_from(t.user_links.join(t.users, U.id == L.user_id))
            .where(L.org_id == org_id)
            .order_by(U.email, L.platform, L.identity)
        )
    ).all()
    return [
        {
            "email": r.email,
            "role": r.role,
            "platform": r.platform,
            "identity": r.identity,
            "createdAt": iso(r.created_at),
        }
        for r in rows
    ]


async def reviewer(conn: Conn, org_id: str, platform: str, identity: str) -> Reviewer | None:
    """The user linked to ``identity`` in ``org_id`` (``None``: not linked there). On
    ``email`` the identity is the user's own address: no link is needed."""
    if platform == "email":
        row = (
            await conn.execute(
                sa.select(U.id, U.email, U.role, U.org_id).where(
                    U.org_id == org_id,
                    U.email == identity.strip().lower(),
                    U.disabled_at.is_(None),
                )
            )
        ).first()
        return None if row is None else Reviewer(row.id, row.email, row.role, row.org_id)
    if platform == "teams":
        identity = identity.lower()
    row = (
        await conn.execute(
            sa.select(U.id, U.email, U.role, U.org_id)
            .select_from(t.user_links.join(t.users, U.id == L.user_id))
            .where(
                L.org_id == org_id,
                L.platform == platform,
                L.identity == identity,
                U.org_id == org_id,
                U.disabled_at.is_(None),
            )
        )
    ).first()
    return None if row is None else Reviewer(row.id, row.email, row.role, row.org_id)


async def _user(conn: Conn, org_id: str, email: str) -> Any:
    row = (
        await conn.execute(
            sa.select(U.id, U.email).where(U.org_id == org_id, U.email == email.strip().lower())
        )
    ).first()
    if row is None:
        raise NotFound(f"no user {quoted(email)} in this organization", rule="user.not_found")
    return row


async def _view(conn: Conn, org_id: str, platform: str, identity: str) -> LinkView:
    found = await reviewer(conn, org_id, platform, identity)
    assert found is not None
    return {
        "email": found.email,
        "role": found.role,
        "platform": platform,
        "identity": identity,
        "canReview": "agent:review" in {s.value for s in found.principal().scopes},
    }
