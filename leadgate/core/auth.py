"""Organizations' principals: roles, scopes, API keys."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from leadgate.core.errors import PermissionDenied, ValidationError, quoted


class Scope(enum.StrEnum):
    """Permissions an API key or a user role can carry."""

    trigger = "agent:trigger"
    review = "agent:review"
    update = "agent:update"


class Role(enum.StrEnum):
    """User roles and what they grant (SPEC 1)."""

    owner = "Owner"
    admin = "Admin"
    member = "Member"
    viewer = "Viewer"

    @classmethod
    def parse(cls, value: str) -> Role:
        """A role by name, case-insensitively (``member`` is ``Member``)."""
        for role in cls:
            if role.value.lower() == value.strip().lower():
                return role
        allowed = ", ".join(r.value for r in cls)
        raise ValidationError(f"unknown role {quoted(value)}; allowed: {allowed}", rule="user.role")


ROLE_SCOPES: dict[Role, frozenset[Scope]] = {
    Role.owner: frozenset({Scope.trigger, Scope.review, Scope.update}),
    Role.admin: frozenset({Scope.trigger, Scope.review, Scope.update}),
    Role.member: frozenset({Scope.trigger, Scope.review}),
    Role.viewer: frozenset(),
}


@dataclass(frozen=True)
class Principal:
    """Who is calling: an API key or a console user, always inside one organization."""

    org_id: str
    scopes: frozenset[Scope]
    key_id: str | None = None
    user_id: str | None = None
    #: The audit name of a caller that is neither a key nor a user (``cli:alice``: the
    #: command line run by operating-system user alice).
    name: str | None = None

    @property
    def actor(self) -> str:
        """Audit name of the caller."""
        if self.user_id:
            return f"user:{self.user_id}"
        if self.key_id is None and self.name:
            return self.name
        return f"key:{self.key_id}"

    def require(self, scope: Scope) -> None:
        """Raise :class:`PermissionDenied` naming the missing scope."""
        if scope not in self.scopes:
            raise PermissionDenied(
                f"this action requires the {scope.value} permission", rule=f"scope.{scope.value}"
            )
