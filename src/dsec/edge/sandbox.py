"""A live sandbox as the edge holds it in memory, and its fork layer chain."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from dsec.backends.base import Backend, SandboxHandle
from dsec.edge.files import SandboxFiles
from dsec.edge.guestfiles import GuestFiles
from dsec.edge.sessions import Session
from dsec.edge.store import Record
from dsec.layers.userdb import Reader
from dsec.models import DEFAULT_WORKDIR, SandboxInfo

# A fork stacks its parent's fork layers instead of copying them; beyond this depth the
# chain is flattened into one layer (overlayfs mount options are limited to a page).
MAX_FORK_CHAIN = 16


def _chain(extra_lower: str | None) -> list[str]:
    """A record's fork layers, top first (stored colon-separated; our paths have no colons)."""
    return extra_lower.split(":") if extra_lower else []


@dataclass
class Sandbox:
    """A live sandbox as the edge holds it in memory."""

    record: Record
    backend: Backend
    handle: SandboxHandle
    root_fd: int
    files: SandboxFiles
    uid: int
    gid: int
    home: str
    sessions: dict[str, Session] = field(default_factory=dict)
    counter: itertools.count[int] = field(default_factory=itertools.count)
    stopping: bool = False
    stats: Counter[str] = field(default_factory=Counter)  # timeouts, output_truncated, disk_full
    seen_events: dict[str, int] = field(default_factory=dict)  # kernel counters at the last look
    audit_session: int | None = None  # kernel audit session of all its processes
    disk_was_full: bool = False
    busy: int = 0  # operations in flight (execs, session runs, file ops): the idle reaper skips it
    # the file API through processes inside, where the host cannot reach the files (root_fd -1)
    guest: GuestFiles | None = None
    image_env: dict[str, str] = field(default_factory=dict)  # its image's ENV: under the spec's
    users: Reader = field(default=lambda _path: None)  # its /etc/passwd and /etc/group, for names

    @property
    def workdir(self) -> str:
        """The cwd of its execs and sessions (the record holds the effective one, see
        EdgeLifecycle._effective)."""
        return self.record.spec.workdir or DEFAULT_WORKDIR

    @property
    def id(self) -> str:
        return self.record.id

    def info(self, edge: str) -> SandboxInfo:
        return self.record.info(edge, self.handle.timings_ms)
