"""Host id ranges: every sandbox on a host runs as a range of host uids and gids of its own.

Range ``k`` is host ids ``k * 65536 .. k * 65536 + 65535`` (container id N is host id
``base + N``); ranges start above the layer store's canonical range.
The layer store keeps its trees owned by one canonical range (``uid_offset``, 100000 by
default), which no sandbox is ever given: a sandbox sees its layers through idmapped
mounts (native/dsec-idmap.h), so root of one sandbox, should it get out, owns neither a
file of the store nor a file of another sandbox.

Ranges are allocated host-wide, across every edge process on the host (the edges of a
local cluster share one kernel; one registry per host, whatever each edge's settings):
range ``k`` is taken while a process holds an exclusive flock(2) on ``<registry>/<k>``,
or while the process recorded in that file (the sandbox's init, by pid and start time)
still runs, so a sandbox whose edge died keeps its range until the edge comes back and
adopts it (or it ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

from dsec import errors
from dsec.isolation import linux

RANGE = 65536
_MAX_ID = 1 << 32


class IdRange:
    """One claimed range; the claim lasts until release() (or this process ends)."""

    def __init__(self, ranges: IdRanges, slot: int, fd: int) -> None:
        self.ranges, self.slot, self._fd = ranges, slot, fd
        self.base = slot * RANGE

    def bind(self, pid: int, start_time: int) -> None:
        """Record the sandbox's init as the range's holder (it outlives an edge restart)."""
        if self._fd >= 0:
            _write(self._fd, f"{pid} {start_time}\n")

    def release(self, *, keep_holder: bool = False) -> None:
        """Free the range (its sandbox is gone). With `keep_holder`, the recorded init
        keeps it taken for as long as it runs."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        if not keep_holder:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # drops the lock
        self.ranges._free(self.slot)


class IdRanges:
    """The host's sandbox id ranges (see the module's docstring)."""

    def __init__(self, registry: Path, above: int) -> None:
        """Ranges lying wholly above host id `above` (the end of the store's canonical range)."""
        self.first_slot = -(-max(above, 1) // RANGE)
        self.end_slot = _MAX_ID // RANGE - 1  # the last range would hold (uid_t)-1
        if self.first_slot >= self.end_slot:
            raise errors.InvalidRequest(f"no sandbox id range fits above host id {above}")
        self.count = self.end_slot - self.first_slot
        self.registry = registry
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._next = self.first_slot
        self._me = f"{os.getpid()} {linux.proc_start_time(os.getpid()) or 0}\n"
        registry.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(registry, 0o700)

    def claim(self, prefer: int | None = None) -> IdRange:
        """A free range, held by this process until released: range `prefer` (a slot) if it
        is free (an image build's storage keeps the owner it had)."""
        with self._lock:
            if prefer is not None and self.first_slot <= prefer < self.end_slot and prefer not in self._held:
                fd = self._try(prefer)
                if fd is not None:
                    self._held.add(prefer)
                    _write(fd, self._me)
                    return IdRange(self, prefer, fd)
            for i in range(self.count):
                slot = self.first_slot + (self._next - self.first_slot + i) % self.count
                if slot in self._held:
                    continue
                fd = self._try(slot)
                if fd is not None:
                    self._held.add(slot)
                    self._next = slot + 1
                    _write(fd, self._me)  # until bind(): this process holds it
                    return IdRange(self, slot, fd)
        raise errors.CapacityExhausted(
            f"every sandbox id range of this host ({self.count}) is in use; stop some sandboxes"
        )

    def adopt(self, base: int, pid: int, start_time: int) -> IdRange | None:
        """Claim again the range of a sandbox this process adopts (after an edge restart);
        None when `base` is not a range of this registry or another process holds it."""
        slot, rest = divmod(base, RANGE)
        if rest or not self.first_slot <= slot < self.end_slot:
            return None
        with self._lock:
            if slot in self._held:
                return None
            fd = self._try(slot, holder=(pid, start_time))
            if fd is None:
                return None
            self._held.add(slot)
        r = IdRange(self, slot, fd)
        r.bind(pid, start_time)
        return r

    def _free(self, slot: int) -> None:
        with self._lock:
            self._held.discard(slot)

    def _try(self, slot: int, holder: tuple[int, int] | None = None) -> int | None:
        """The locked registry file of `slot` if the range is free (or held only by
        `holder`, a sandbox being adopted), else None."""
        fd = os.open(self.registry / str(slot), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        owner = _holder(fd)
        if owner is not None and owner != holder and _alive(*owner):
            os.close(fd)
            return None
        return fd


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _holder(fd: int) -> tuple[int, int] | None:
    try:
        pid, start = os.pread(fd, 64, 0).split()[:2]
        return int(pid), int(start)
    except (OSError, ValueError):
        return None


def _alive(pid: int, start_time: int) -> bool:
    return pid > 0 and linux.proc_start_time(pid) == start_time


def range_of(pid: int) -> int | None:
    """The host uid that uid 0 of `pid`'s user namespace maps to (its range's base)."""
    try:
        with open(f"/proc/{pid}/uid_map") as f:
            for line in f:
                inside, outside, _count = (int(x) for x in line.split())
                if inside == 0:
                    return outside
    except (OSError, ValueError):
        return None
    return None
