"""Registry logins per project: what a pull by a project's member (`POST /v1/images/pull`)
presents to a private registry. A part of `IAM` (store.py), which holds the database; what it
uses of the rest of IAM is declared at the top.

A login is written by the project's members (or admins) and read back only as the registry
and the user name: the secret leaves the database only towards the edge that pulls, in the
pull's request. (It is stored as given: the database holds token hashes and quota, and is
the operator's to protect: SQLite 0600 in a 0700 directory; PostgreSQL's own access rules.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from dsec.errors import InvalidRequest, NotFound
from dsec.iam.db import Part
from dsec.layers.pull import REGISTRY_RE

MAX_LOGINS = 32  # per project


def check_registry_name(registry: str) -> str:
    if not isinstance(registry, str) or len(registry) > 255 or not REGISTRY_RE.match(registry):
        raise InvalidRequest(
            f"{registry[:80]!r} is not a registry: give its host[:port] as image references name it "
            "(docker.io, ghcr.io, registry.example.com:5000)",
            reason="bad_registry",
        )
    return registry.lower()


class RegistryLogins(Part):
    if TYPE_CHECKING:

        def get_project(self, name: str) -> Any: ...

    def set_registry_login(self, project: str, registry: str, username: str, secret: str) -> None:
        """Keep `project`'s login to `registry` (replacing one it had)."""
        self.get_project(project)  # NotFound for a project that does not exist
        registry = check_registry_name(registry)
        if not 1 <= len(username) <= 255 or not 1 <= len(secret) <= 8192 or "\0" in username + secret:
            raise InvalidRequest(
                "a registry login is a user name of 1-255 and a password or token of 1-8192 characters",
                reason="bad_login",
            )
        with self._write() as db:
            sql = "SELECT COUNT(*) FROM registry_logins WHERE project = ? AND registry != ?"
            have = db.execute(sql, (project, registry)).fetchone()[0]
            if have >= MAX_LOGINS:
                raise InvalidRequest(f"project {project} has {have} registry logins, the most it may keep")
            db.execute(
                "INSERT INTO registry_logins (project, registry, username, secret, updated_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (project, registry) DO UPDATE SET"
                " username = excluded.username, secret = excluded.secret, updated_at = excluded.updated_at",
                (project, registry, username, secret, time.time()),
            )

    def registry_logins(self, project: str) -> list[dict[str, Any]]:
        """The project's logins as anyone may see them: registry and user, no secret."""
        rows = self._read(
            "SELECT registry, username, updated_at FROM registry_logins WHERE project = ? ORDER BY registry",
            (project,),
        )
        return [{"registry": r[0], "username": r[1], "updated_at": r[2]} for r in rows]

    def registry_login(self, project: str, registry: str) -> tuple[str, str] | None:
        """(user, secret) of the project's login to `registry`, for the pull that needs it."""
        rows = self._read(
            "SELECT username, secret FROM registry_logins WHERE project = ? AND registry = ?",
            (project, registry.lower()),
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def delete_registry_login(self, project: str, registry: str) -> None:
        with self._write() as db:
            n = db.execute(
                "DELETE FROM registry_logins WHERE project = ? AND registry = ?", (project, registry.lower())
            ).rowcount
        if not n:
            raise NotFound(f"project {project} has no login to {registry}", reason="no_login")
