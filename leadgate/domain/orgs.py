"""Organizations, users and API keys.

API keys look like ``lg.<key id>.<secret>``. Only a SHA-256 of the secret is stored: the
secret is 256 random bits, so a fast hash is the right tool (a slow password hash buys
nothing against brute force of 2^256 and would cost milliseconds on every request).
User passwords, which are low-entropy, use argon2.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import Any, NotRequired, TypedDict

import sqlalchemy as sa
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from leadgate.core.auth import ROLE_SCOPES, Principal, Role, Scope
from leadgate.core.clock import Clock, IdFactory, iso
from leadgate.core.errors import Conflict, NotFound, PermissionDenied, ValidationError, quoted
from leadgate.core.limits import PASSWORD_MAX, PASSWORD_MIN
from leadgate.database import schema as t
from leadgate.database.db import Conn
from leadgate.database.sql import is_locked, locked_by_id

KEY_PREFIX = "lg"
_hasher = PasswordHasher()
_dummy_hash: str | None = None


def _verify_password(password_hash: str | None, password: str) -> bool:
    """argon2 check; an unknown user is checked against a dummy hash so that both
    failures cost the same time (no email enumeration by timing)."""
    global _dummy_hash
    if password_hash is None:
        if _dummy_hash is None:
            _dummy_hash = _hasher.hash(secrets.token_urlsafe(16))
        password_hash = _dummy_hash
        password = ""
    try:
        return bool(_hasher.verify(password_hash, password))
    except (VerificationError, InvalidHashError):
        return False


def _hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_scopes(values: list[str]) -> frozenset[Scope]:
    """Validate scope names; unknown ones are a clear error."""
    scopes = set()
    for value in values:
        try:
            scopes.add(Scope(value))
        except ValueError:
            allowed = ", ".join(s.value for s in Scope)
            raise ValidationError(
                f"unknown scope {quoted(value)}; allowed: {allowed}", rule="key.scope"
            ) from None
    if not scopes:
        raise ValidationError("an API key needs at least one scope", rule="key.scope")
    return frozenset(scopes)


def validate_name(name: str, what: str, *, id_prefix: str | None = None) -> str:
    """Names: 1..200 printable characters, trimmed; with ``id_prefix``, not shaped like
    an id of that kind (``agt_...``), which the name would be mistaken for wherever a
    reference takes an id or a name."""
    name = name.strip()
    if not name or len(name) > 200 or not name.isprintable():
        raise ValidationError(
            f"{what} name must be 1..200 printable characters", rule=f"{what}.name"
        )
    if id_prefix is not None and name.lower().startswith(id_prefix + "_"):
        raise ValidationError(
            f"{what} name must not look like an id ({id_prefix}_...)", rule=f"{what}.name"
        )
    return name


class NewOrgView(TypedDict):
    """A new organization and its Owner key (the secret, shown once)."""

    id: str
    name: str
    apiKey: str


async def create_org(conn: Conn, clock: Clock, ids: IdFactory, name: str) -> NewOrgView:
    """Create an organization with an Owner key carrying every scope."""
    name = validate_name(name, "organization", id_prefix="org")
    exists = await conn.scalar(
        sa.select(t.organizations.c.id).where(t.organizations.c.name == name)
    )
    if exists:
        raise Conflict(
            f"an organization named {quoted(name)} already exists", rule="org.name_taken"
        )
    org_id = ids.new("org")
    await conn.execute(
        t.organizations.insert().values(id=org_id, name=name, created_at=clock.now_ms())
    )
    key = await create_key(conn, clock, ids, org_id, ROLE_SCOPES[Role.owner], name="owner")
    return {"id": org_id, "name": name, "apiKey": key["key"]}


class OrgView(TypedDict):
    """An organization as the operator lists it."""

    id: str
    name: str
    createdAt: str | None


async def list_orgs(conn: Conn) -> list[OrgView]:
    """Every organization (id, name, created), oldest first: the operator's view."""
    o = t.organizations.c
    rows = (await conn.execute(sa.select(t.organizations).order_by(o.created_at, o.id))).all()
    return [{"id": r.id, "name": r.name, "createdAt": iso(r.created_at)} for r in rows]


class OrgRow(TypedDict):
    """An ``organizations`` row, by column."""

    id: str
    name: str
    created_at: int


async def find_org(conn: Conn, ref: str) -> OrgRow:
    """An organization by id or name."""
    row = (
        await conn.execute(
            sa.select(t.organizations)
            .where(sa.or_(t.organizations.c.id == ref, t.organizations.c.name == ref))
            # The id first: an organization named like another's id must not take it over.
            .order_by(sa.case((t.organizations.c.id == ref, 0), else_=1))
        )
    ).first()
    if row is None:
        raise NotFound(f"no organization {quoted(ref)}", rule="org.not_found")
    return OrgRow(id=row.id, name=row.name, created_at=row.created_at)


class NewKeyView(TypedDict):
    """A new API key: ``key`` is its secret, shown once; ``name`` only when it has one."""

    id: str
    key: str
    scopes: list[Scope]
    name: NotRequired[str]


async def create_key(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    org_id: str,
    scopes: frozenset[Scope],
    *,
    name: str | None = None,
) -> NewKeyView:
    """Create a key (``name``: an optional label); the secret is returned once and never
    stored."""
    key_id = ids.new("key")
    secret = secrets.token_urlsafe(32)
    label = validate_name(name, "key") if name is not None else None
    await conn.execute(
        t.api_keys.insert().values(
            id=key_id,
            org_id=org_id,
            secret_hash=_hash_secret(secret),
            scopes=sorted(s.value for s in scopes),
            created_at=clock.now_ms(),
            name=label,
        )
    )
    out = NewKeyView(id=key_id, key=f"{KEY_PREFIX}.{key_id}.{secret}", scopes=sorted(scopes))
    if label is not None:
        out["name"] = label
    return out


async def authenticate_key(conn: Conn, raw: str) -> Principal | None:
    """The principal for a raw key, or ``None`` (unknown, malformed or revoked)."""
    parts = raw.strip().split(".")
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(raw) > 200:
        return None
    _, key_id, secret = parts
    row = (
        await conn.execute(
            sa.select(t.api_keys).where(
                t.api_keys.c.id == key_id, t.api_keys.c.revoked_at.is_(None)
            )
        )
    ).first()
    if row is None or not hmac.compare_digest(row.secret_hash, _hash_secret(secret)):
        return None
    return Principal(
        org_id=row.org_id, scopes=frozenset(Scope(s) for s in row.scopes), key_id=key_id
    )


class NewUserView(TypedDict):
    """A new console user; ``name`` only when it has one."""

    id: str
    email: str
    role: str
    orgId: str
    name: NotRequired[str]


async def create_user(
    conn: Conn,
    clock: Clock,
    ids: IdFactory,
    org_id: str,
    email: str,
    role: str,
    password_hash: str,
    *,
    name: str | None = None,
) -> NewUserView:
    """Create a console user with a role (any case: ``member`` is ``Member``) and an
    optional display name; ``password_hash`` is the password's :func:`hash_password`,
    made before the transaction (argon2 is slow by design)."""
    role_enum = Role.parse(role)
    label = validate_name(name, "user") if name is not None else None
    email = email.strip().lower()
    if "@" not in email or len(email) > 320:
        raise ValidationError("user email must be an email address", rule="user.email")
    if await conn.scalar(sa.select(t.users.c.id).where(t.users.c.email == email)):
        raise Conflict(f"a user {quoted(email)} already exists", rule="user.email_taken")
    user_id = ids.new("usr")
    await conn.execute(
        t.users.insert().values(
            id=user_id,
            org_id=org_id,
            email=email,
            role=role_enum.value,
            password_hash=password_hash,
            created_at=clock.now_ms(),
            name=label,
        )
    )
    out = NewUserView(id=user_id, email=email, role=role_enum.value, orgId=org_id)
    if label is not None:
        out["name"] = label
    return out


def hash_password(password: str) -> str:
    """An argon2 hash of a console password of 8..1,024 characters (``user.password``
    otherwise). Blocking and slow by design: run it in a worker thread, outside any
    transaction."""
    if not PASSWORD_MIN <= len(password) <= PASSWORD_MAX:
        raise ValidationError(
            f"password must be {PASSWORD_MIN} to {PASSWORD_MAX:,} characters",
            rule="user.password",
        )
    return _hasher.hash(password)


_U = t.users.c
_S = t.console_sessions.c
#: A user's public columns (never the password hash), as :func:`_user_fields` reads them.
_USER_COLUMNS = (_U.id, _U.email, _U.name, _U.role, _U.disabled_at, _U.created_at)


class UserView(TypedDict):
    """A console user's public fields (never the password hash)."""

    id: str
    email: str
    name: str | None
    role: str
    disabled: bool
    createdAt: str | None


class ListedUserView(UserView):
    """A console user as ``user list`` shows it: with its open console sessions."""

    sessions: int


class UpdatedUserView(UserView):
    """A console user after a change: with how many console sessions it ended."""

    sessionsEnded: int


def _user_fields(row: Any) -> UserView:
    return {
        "id": row.id,
        "email": row.email,
        "name": row.name,
        "role": row.role,
        "disabled": row.disabled_at is not None,
        "createdAt": iso(row.created_at),
    }


async def list_users(conn: Conn, clock: Clock, org_id: str) -> list[ListedUserView]:
    """The organization's console users, oldest first, with how many console sessions
    each has open (never a password hash)."""
    sessions = (
        sa.select(sa.func.count())
        .where(_S.user_id == _U.id, _S.expires_at > clock.now_ms())
        .scalar_subquery()
    )
    rows = await conn.execute(
        sa.select(*_USER_COLUMNS, sessions.label("sessions"))
        .where(_U.org_id == org_id)
        .order_by(_U.created_at, _U.id)
    )
    return [{**_user_fields(row), "sessions": row.sessions} for row in rows]


async def update_user(
    conn: Conn,
    clock: Clock,
    org_id: str,
    email: str,
    *,
    role: str | None = None,
    name: str | None = None,
    password_hash: str | None = None,
    disabled: bool | None = None,
    end_sessions: bool = False,
) -> UpdatedUserView:
    """Change a console user of ``org_id``: role (applies to open sessions at their next
    request), display name, password (its :func:`hash_password`, made before the
    transaction), disabled or not. A new password, disabling, or
    ``end_sessions`` deletes the user's console sessions (``sessionsEnded`` says how
    many); disabling also keeps the user from every chat decision (their links stay,
    for when they are enabled again)."""
    user = await find_user(conn, org_id, email, include_disabled=True)
    values: dict[str, Any] = {}
    if role is not None:
        values["role"] = Role.parse(role).value
    if name is not None:
        values["name"] = validate_name(name, "user")
    if password_hash is not None:
        values["password_hash"] = password_hash
        end_sessions = True
    if disabled is not None and disabled != user["disabled"]:
        values["disabled_at"] = clock.now_ms() if disabled else None
    if disabled:
        end_sessions = True
    if values:
        await conn.execute(t.users.update().where(_U.id == user["id"]).values(**values))
    ended = 0
    if end_sessions:
        ended_sessions = _USERS_BY_ID if conn.dialect.name == "postgresql" else _USERS
        result = await conn.execute(ended_sessions, {"p_user": user["id"]})
        ended = int(result.rowcount or 0)
    row = (await conn.execute(sa.select(*_USER_COLUMNS).where(_U.id == user["id"]))).one()
    return {**_user_fields(row), "sessionsEnded": ended}


async def login(
    conn: Conn, clock: Clock, ids: IdFactory, email: str, password: str, ttl_ms: int
) -> str | None:
    """Check a password; returns a new console session token or ``None`` (one
    connection: tests and tools; the console uses the steps below, argon2 outside any
    write transaction)."""
    found = await login_user(conn, email)
    # argon2 is deliberately slow (tens of ms): keep it off the event loop.
    ok = await asyncio.to_thread(verify_password, found[1] if found else None, password)
    if found is None or not ok:
        return None
    return await create_console_session(conn, clock, ids, found[0], ttl_ms)


async def login_user(conn: Conn, email: str) -> tuple[str, str] | None:
    """(user id, password hash) of a console user by email, if any."""
    row = (
        await conn.execute(
            sa.select(t.users.c.id, t.users.c.password_hash).where(
                t.users.c.email == email.strip().lower(), t.users.c.disabled_at.is_(None)
            )
        )
    ).first()
    return None if row is None else (row.id, row.password_hash)


def verify_password(password_hash: str | None, password: str) -> bool:
    """argon2 check (blocking, CPU-bound: run it in a worker thread); an unknown user
    (``None``) is checked against a dummy hash so both failures cost the same time."""
    return _verify_password(password_hash, password)


_PAST = _S.expires_at <= sa.bindparam("p_now")
#: The console sessions expired at ``p_now`` (anyone's), deleted.
_EXPIRED = t.console_sessions.delete().where(_PAST)
#: PostgreSQL: the same, their rows locked in id order first (:func:`locked_by_id`): a
#: plain ``DELETE`` locks them in the order its scan finds them (physical order at size),
#: and two logins at once, or a login beside a user's sessions ended (below), met the
#: other way round as a deadlock (40P01).
_EXPIRED_BY_ID = t.console_sessions.delete().where(
    is_locked(t.console_sessions, locked_by_id(t.console_sessions, _PAST, name="expired"))
)
_OF_USER = _S.user_id == sa.bindparam("p_user")
#: A user's console sessions (``p_user``), deleted: their password changed, or disabled.
_USERS = t.console_sessions.delete().where(_OF_USER)
#: PostgreSQL: the same in id order, as the expired sessions are deleted.
_USERS_BY_ID = t.console_sessions.delete().where(
    is_locked(t.console_sessions, locked_by_id(t.console_sessions, _OF_USER, name="ended"))
)


async def create_console_session(
    conn: Conn, clock: Clock, ids: IdFactory, user_id: str, ttl_ms: int
) -> str:
    """A new console session for ``user_id``; returns its token (only a hash is stored).
    Sessions that have expired, anyone's, are deleted in the same transaction: nothing
    else would, and a login is rare enough (one password check at a time) to pay for it."""
    token = secrets.token_urlsafe(32)
    expired = _EXPIRED_BY_ID if conn.dialect.name == "postgresql" else _EXPIRED
    await conn.execute(expired, {"p_now": clock.now_ms()})
    await conn.execute(
        t.console_sessions.insert().values(
            id=ids.new("cs"),
            token_hash=_hash_secret(token),
            user_id=user_id,
            expires_at=clock.now_ms() + ttl_ms,
            created_at=clock.now_ms(),
        )
    )
    return token


async def authenticate_session(conn: Conn, clock: Clock, token: str) -> Principal | None:
    """The principal of a console session cookie, or ``None``."""
    row = (
        await conn.execute(
            sa.select(t.users.c.id, t.users.c.org_id, t.users.c.role)
            .select_from(
                t.console_sessions.join(t.users, t.users.c.id == t.console_sessions.c.user_id)
            )
            .where(
                t.console_sessions.c.token_hash == _hash_secret(token),
                t.console_sessions.c.expires_at > clock.now_ms(),
                t.users.c.disabled_at.is_(None),
            )
        )
    ).first()
    if row is None:
        return None
    return Principal(org_id=row.org_id, scopes=ROLE_SCOPES[Role(row.role)], user_id=row.id)


async def delete_session(conn: Conn, token: str) -> bool:
    """Log a console session out (delete its row); ``False`` when there was none."""
    result = await conn.execute(
        t.console_sessions.delete().where(t.console_sessions.c.token_hash == _hash_secret(token))
    )
    return bool(result.rowcount)


class ConsoleUserView(TypedDict):
    """The console's signed-in user: public fields, organization and scopes."""

    id: str
    email: str
    role: str
    orgId: str
    orgName: str
    name: str | None
    scopes: list[str]


async def get_user(conn: Conn, user_id: str) -> ConsoleUserView:
    """A console user's public fields (never the password hash), with the org name."""
    row = (
        await conn.execute(
            sa.select(
                t.users.c.id,
                t.users.c.email,
                t.users.c.role,
                t.users.c.org_id,
                t.users.c.name,
                t.organizations.c.name.label("org_name"),
            )
            .select_from(t.users.join(t.organizations, t.organizations.c.id == t.users.c.org_id))
            .where(t.users.c.id == user_id)
        )
    ).first()
    if row is None:
        raise NotFound(f"no user {quoted(user_id)}", rule="user.not_found")
    role = Role(row.role)
    return {
        "id": row.id,
        "email": row.email,
        "role": role.value,
        "orgId": row.org_id,
        "orgName": row.org_name,
        "name": row.name,
        "scopes": sorted(s.value for s in ROLE_SCOPES[role]),
    }


class KeyView(TypedDict):
    """An API key as listed (never its secret or the secret's hash)."""

    id: str
    name: str | None
    scopes: list[str]
    createdAt: str | None
    revokedAt: str | None
    active: bool


async def list_keys(conn: Conn, org_id: str) -> list[KeyView]:
    """The organization's API keys, oldest first (never a secret or its hash)."""
    k = t.api_keys.c
    rows = await conn.execute(
        sa.select(k.id, k.name, k.scopes, k.created_at, k.revoked_at)
        .where(k.org_id == org_id)
        .order_by(k.created_at, k.id)
    )
    return [
        {
            "id": r.id,
            "name": r.name,
            "scopes": sorted(r.scopes),
            "createdAt": iso(r.created_at),
            "revokedAt": iso(r.revoked_at),
            "active": r.revoked_at is None,
        }
        for r in rows
    ]


class RevokedKeyView(TypedDict):
    """A key just revoked."""

    id: str
    revokedAt: str | None
    active: bool


async def revoke_key(conn: Conn, clock: Clock, org_id: str, key_id: str) -> RevokedKeyView:
    """Revoke a key of ``org_id`` (its holders are refused within the principal cache
    time, 5 s). Revoking a revoked key is a 409; another organization's key is a 404."""
    k = t.api_keys.c
    row = (
        await conn.execute(sa.select(k.id, k.revoked_at).where(k.id == key_id, k.org_id == org_id))
    ).first()
    if row is None:
        raise NotFound(f"no API key {quoted(key_id)} in this organization", rule="key.not_found")
    if row.revoked_at is not None:
        raise Conflict(f"API key {key_id} is already revoked", rule="key.revoked")
    now = clock.now_ms()
    res = await conn.execute(
        t.api_keys.update().where(k.id == key_id, k.revoked_at.is_(None)).values(revoked_at=now)
    )
    if not res.rowcount:
        # A revoke of the same key committed between the read and this update
        # (PostgreSQL's READ COMMITTED: the update waited for it, then matched nothing):
        # this one answered success with a time that was never stored.
        raise Conflict(f"API key {key_id} is already revoked", rule="key.revoked")
    return {"id": key_id, "revokedAt": iso(now), "active": False}


async def key_status(conn: Conn, raw: str) -> tuple[str, str] | None:
    """(key id, organization id) of a raw key that is valid now, else ``None``."""
    principal = await authenticate_key(conn, raw)
    if principal is None or principal.key_id is None:
        return None
    return principal.key_id, principal.org_id


async def find_user(
    conn: Conn, org_id: str, email: str, *, include_disabled: bool = False
) -> UserView:
    """A console user of ``org_id`` by email (404 otherwise; a disabled one is 403
    ``user.disabled`` unless ``include_disabled``)."""
    row = (
        await conn.execute(
            sa.select(*_USER_COLUMNS).where(_U.org_id == org_id, _U.email == email.strip().lower())
        )
    ).first()
    if row is None:
        raise NotFound(
            f"no console user {quoted(email)} in this organization", rule="user.not_found"
        )
    if row.disabled_at is not None and not include_disabled:
        raise PermissionDenied(f"the console user {row.email} is disabled", rule="user.disabled")
    return _user_fields(row)
