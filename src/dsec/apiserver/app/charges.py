"""Copies of a sandbox's state (snapshots, fork layers, memory checkpoints) are charged to its
project before they are made.

A copy reserves a slot and what the project's snapshot quota has left, up to an upper bound
of what it can take (`copy_bound_mb`; a fork layer: what its parent's writable layer last
measured, with some room, `fork_layer_mb`; it lives on the edge's run tmpfs, so it counts
against the memory quota too). The MiB reserved are the edge's cap: a copy that
would be bigger is refused there before a byte is written (for a microVM's snapshot, the
spool of its archive is cut at the cap, so holes a sparse file has in the guest count at
their full size). Such a refusal grows the reservation to what the copy needs, so the quota
itself answers (quota_exceeded naming its limit), or, when room came free meanwhile, the
copy runs again once. A copy made settles at its real size under its own key, and one over
the quota then is undone. The reservation is pending until then: owned by this process,
released by the reconciler if it dies first."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dsec import errors
from dsec.iam import IAM
from dsec.models import SandboxInfo, SandboxSpec

_T = TypeVar("_T")

# Besides the guest's RAM, a memory checkpoint holds its kernel, devices and CRIU's own images.
_CHECKPOINT_SLACK_MB = 256
_HEADER_BYTES = 10240  # an archive's headers per inode (names of up to 4 KiB): microVM snapshots


def mib(n_bytes: int) -> int:
    return -(-n_bytes // (1 << 20))


def copy_bound_mb(spec: SandboxSpec, *, memory: bool = False) -> int:
    """An upper bound of what a copy of the sandbox's files takes (its disk, and the headers of
    every inode it may hold), and of its memory too (`memory`: a checkpoint)."""
    files = spec.disk_mb + mib(spec.disk_inodes * _HEADER_BYTES)
    return files + (spec.memory_mb + _CHECKPOINT_SLACK_MB if memory else 0)


def fork_layer_mb(source: SandboxInfo) -> int:
    """What the fork layer of `source` is expected to take: its writable layer as last
    measured, with room to grow until it is frozen (one that grew past that asks for more:
    `ChargedCopy.run`), at most its bound. Forks are frequent and their layers are held as
    memory: a fork in flight holds no more of the quota than it needs."""
    used = mib(int(source.telemetry.get("disk_used_bytes", 0)))
    return min(copy_bound_mb(source.spec), used + used // 4 + 16)


def own_disks(spec: SandboxSpec) -> bool:
    """Whether a fork's children each get a copy of their parent's disk (a microVM: a disk
    cannot be stacked), not one shared layer."""
    return spec.backend == "microvm"


def disk_key(sandbox_id: str) -> str:
    """The snapshot reservation of a fork child's own copy of its parent's disk."""
    return f"disk:{sandbox_id}"


def fork_copies_mb(source: SandboxInfo, n: int) -> tuple[int, int]:
    """What a fork of `n` children is expected to copy into the edge's run tmpfs, and how many
    copies it makes: one shared layer, or a disk per child (each at most its disk_mb)."""
    if not own_disks(source.spec):
        return fork_layer_mb(source), 1
    return n * min(source.spec.disk_mb, fork_layer_mb(source)), n


class ChargedCopy:
    """One copy's reservation, from before it is made until it settles (see the module)."""

    def __init__(
        self,
        iam: IAM,
        project: str,
        want_mb: int,
        *,
        in_ram: bool = False,
        asked: int | None = None,
        copies: int = 1,
    ) -> None:
        """Reserve (QuotaExceeded: no slot, or nothing left). `asked`: the caller's own cap.
        `copies`: the copy is that many (a microVM fork's disks), each settled under a key of
        its own, so each holds a slot from now on (the MiB are held together until then)."""
        self.iam, self.asked = iam, asked
        self.key = f"pending-{secrets.token_hex(8)}"
        self.mb = iam.reserve_snapshot_up_to(self.key, project, want_mb, in_ram=in_ram)
        self.slots: list[str] = []  # the other copies' slots, of no MiB yet
        try:
            for _ in range(copies - 1):
                self.slots.append(f"pending-{secrets.token_hex(8)}")
                iam.reserve_snapshot_up_to(self.slots[-1], project, 0, in_ram=in_ram)
        except BaseException:
            self.release()
            raise

    @property
    def cap(self) -> int:
        reserved = self.mb << 20
        return reserved if self.asked is None else min(reserved, self.asked)

    async def run(self, attempt: Callable[[int], Awaitable[_T]]) -> _T:
        """`attempt(cap)` makes the copy; the reservation is given back if it fails."""
        try:
            for again in (True, False):
                cap = self.cap
                try:
                    return await attempt(cap)
                except errors.QuotaExceeded as e:
                    need = e.details.get("needed_bytes")
                    if not again or not isinstance(need, int) or e.details.get("cap_bytes") != cap:
                        raise  # (not a refusal of this cap: the count of fork layers, say)
                    if self.asked is not None and self.asked <= self.mb << 20:
                        raise  # the caller's own cap
                    self.iam.resize_snapshot(self.key, mib(need))  # the quota's own refusal, or room
                    self.mb = mib(need)
            raise AssertionError("unreachable")
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for key in (self.key, *self.slots):
            try:
                self.iam.release_snapshot(key)
            except errors.DsecError:
                self.iam.abandon(key)  # (the database is away: the reconciler releases it)

    async def settle(
        self, key: str, size_bytes: int, undo: Callable[[], Awaitable[object]], *, min_mb: int = 0
    ) -> None:
        """The copy is made: its reservation moves to `key` at its real size. Over the quota
        (it grew past what was reserved: a snapshot's sparse files count at their full
        size), it is undone and refused."""
        await self.settle_each({key: max(min_mb, mib(size_bytes))}, undo)

    async def settle_each(self, sizes_mb: dict[str, int], undo: Callable[[], Awaitable[object]]) -> None:
        """`settle` for copies made several (`copies`): each key at its own size. The first
        gives up what it held for all before the others take theirs."""
        for pending, key in zip((self.key, *self.slots), sizes_mb, strict=True):
            self.iam.rekey_snapshot(pending, key)
        try:
            for key, mb in sizes_mb.items():
                self.iam.resize_snapshot(key, mb)
        except errors.DsecError:
            with contextlib.suppress(errors.DsecError):
                await undo()
            for key in sizes_mb:
                self.iam.release_snapshot(key)
            raise
