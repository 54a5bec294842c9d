"""Captured output an edge holds: bounded in all and per project, and the JSON it becomes.

Each exec (plain, streamed, trusted) takes a `Hold` on the edge's `OutputBudget` before its
command starts. The bytes a call keeps are charged as its pipes are read, and the JSON an
exec's answer and trajectory entry are made of as it is made; a call holds its output once,
as bytes, then its JSON, never a decoded copy. A call with no room left is not read (the
command blocks writing into its full pipe) and its JSON is not made until room comes back;
what every call holds is given back when its answer has been written (or dropped).

Room: the edge's budget and the project's, both. Progress: the edge's oldest hold may always
take (so one call always finishes and gives its room back: calls waiting on each other cannot
all wait), and a project's oldest may take what the edge has left past its project's budget.
So the edge holds at most its budget plus one call's output and its JSON (the oldest's), and
no project more than its budget plus two calls'.

`Flow` bounds what a streamed exec has read and its reader has yet to take; past it the
pipes are not read, so a slow reader slows the command instead of filling the edge."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsec.http.output import JSON_PER_BYTE, PIECE, HeldReply, json_string, json_text, meta_rest
from dsec.models import ExecResult
from dsec.trajlog import canonical_json

Wake = Callable[[], None]
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_UNBOUNDED = sys.maxsize


def map_large_buffers(threshold: int = PIECE) -> None:
    """Allocations of `threshold` bytes and more in mappings of their own (glibc's
    M_MMAP_THRESHOLD, fixed). Output buffers come and go in tens of MiB: in the heap (where
    glibc's own threshold, moved up to 32 MiB by the first such free, puts them) the holes
    they leave stay resident and a growing one is copied; a mapping goes back at its free and
    grows by mremap. Measured: 10 floods of 16 MiB under a 32 MiB budget, 200 -> 160 MiB peak.
    Nothing happens elsewhere than on glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold)


class OutputBudget:
    """Bytes of output (and its JSON) an edge holds at once: `total`, and `per_project`."""

    def __init__(self, total: int, per_project: int) -> None:
        self.total = total
        self.per_project = per_project
        self.held = 0
        self.peak = 0  # the most ever held at once
        self._projects: dict[str, int] = {}
        self._holds: dict[int, Hold] = {}  # oldest first
        self._by_project: dict[str, dict[int, Hold]] = {}
        self._waiting: set[Wake] = set()
        self._ids = itertools.count()

    def hold(self, project: str) -> Hold:
        h = Hold(self, project, next(self._ids))
        self._holds[h.id] = h
        self._by_project.setdefault(project, {})[h.id] = h
        return h

    def held_by(self, project: str) -> int:
        return self._projects.get(project, 0)

    def _room(self, h: Hold) -> int:
        if next(iter(self._holds)) == h.id:
            return _UNBOUNDED
        edge = max(self.total - self.held, 0)
        if next(iter(self._by_project[h.project])) == h.id:
            return edge
        return min(edge, max(self.per_project - self._projects.get(h.project, 0), 0))

    def _charge(self, h: Hold, n: int) -> None:
        self.held += n
        self._projects[h.project] = self._projects.get(h.project, 0) + n
        if self.held > self.peak:
            self.peak = self.held
        if n < 0 and self._waiting:
            self._wake()

    def _drop(self, h: Hold) -> None:
        self._charge(h, -h.held)
        if self._projects.get(h.project) == 0:
            del self._projects[h.project]
        head = next(iter(self._holds)) == h.id
        del self._holds[h.id]
        mine = self._by_project[h.project]
        del mine[h.id]
        if not mine:
            del self._by_project[h.project]
        if head and self._waiting:  # a new oldest may take now
            self._wake()

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, set()
        for wake in waiting:
            wake()


class Hold:
    """One call's share of the budget (see the module): what it holds, and room to take more."""

    __slots__ = ("budget", "closed", "held", "id", "project")

    def __init__(self, budget: OutputBudget, project: str, ident: int) -> None:
        self.budget = budget
        self.project = project
        self.id = ident
        self.held = 0
        self.closed = False

    def room(self) -> int:
        """Bytes this call may take now (0: it waits)."""
        return 0 if self.closed else self.budget._room(self)

    def take(self, n: int) -> None:
        if n and not self.closed:
            self.held += n
            self.budget._charge(self, n)

    def give(self, n: int) -> None:
        n = min(n, self.held)
        if n > 0 and not self.closed:
            self.held -= n
            self.budget._charge(self, -n)

    def when_room(self, wake: Wake) -> None:
        """Call `wake` (once) when room may have come back."""
        self.budget._waiting.add(wake)

    async def reserve(self, n: int) -> None:
        """Wait until this call may take `n` bytes (or is the one that always may), and take them."""
        while not self.closed and self.room() < n:
            woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.when_room(functools.partial(_settle, woken))
            await woken
        self.take(n)

    def close(self) -> None:
        """Give everything back; the call takes nothing more."""
        if not self.closed:
            self.budget._drop(self)
            self.held = 0
            self.closed = True


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Flow:
    """A streamed exec's output read and not yet taken by its reader (see the module): at most
    `high` bytes before the pipes stop being read; reading resumes below half of it."""

    def __init__(self, high: int = PIECE) -> None:
        self.high = high
        self.queued = 0
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._ready = asyncio.Event()
        self._waiting: set[Wake] = set()

    def put(self, kind: str, item: Any) -> None:
        self._items.append((kind, item))
        if isinstance(item, bytes | bytearray):
            self.queued += len(item)
        self._ready.set()

    def room(self) -> int:
        return self.high - self.queued

    def when_room(self, wake: Wake) -> None:
        self._waiting.add(wake)

    async def get(self) -> tuple[str, Any]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        kind, item = self._items.popleft()
        if isinstance(item, bytes | bytearray):
            self.queued -= len(item)
        if self._waiting and self.queued <= self.high // 2:
            waiting, self._waiting = self._waiting, set()
            for wake in waiting:
                wake()
        return kind, item


# Stand-ins for the output in the observation's JSON: none of its other fields holds text.
_OUT, _ERR = "\x00dsec-stdout\x00", "\x00dsec-stderr\x00"
_OUT_JSON, _ERR_JSON = canonical_json(_OUT), canonical_json(_ERR)


@dataclass
class Observation:
    """An exec's observation as the trajectory log stores it (`doc`: canonical JSON, UTF-8,
    exactly `canonical_json(result.model_dump())`), and where its output lies in it."""

    doc: bytearray
    meta: ExecResult
    stdout: slice
    stderr: slice

    def reply(self, hold: Hold, seq: int | None) -> HeldReply:
        """The answer, made of views of `doc` (the output's JSON is not made twice)."""
        meta = self.meta
        meta.seq = seq
        view = memoryview(self.doc)
        parts: list[bytes | memoryview] = [
            b'{"stdout":',
            view[self.stdout],
            b',"stderr":',
            view[self.stderr],
            b"," + meta_rest(meta),
        ]
        return HeldReply(meta, parts, hold.close)


async def observe(
    meta: ExecResult, stdout: bytearray | bytes, stderr: bytearray | bytes, hold: Hold
) -> Observation:
    """`meta` with this output as an `Observation`, its JSON made under `hold` (each piece's
    room taken before it is made); the output's bytes are given back once it is made."""
    text = canonical_json({**meta.model_dump(), "stdout": _OUT, "stderr": _ERR})
    head, rest = text.split(_ERR_JSON)  # (keys sorted: stderr comes first)
    middle, tail = rest.split(_OUT_JSON)
    most = JSON_PER_BYTE * (len(stdout) + len(stderr)) + len(text)
    if len(stdout) + len(stderr) <= PIECE and hold.room() >= most:  # (most execs: at once)
        err, out = json_text(stderr), json_text(stdout)
        doc = bytearray(b"".join((head.encode(), err, middle.encode(), out, tail.encode())))
        hold.take(len(doc) - len(stdout) - len(stderr))
        at = len(head)
        return Observation(
            doc,
            meta,
            stdout=slice(at + len(err) + len(middle), len(doc) - len(tail)),
            stderr=slice(at, at + len(err)),
        )
    doc = bytearray()
    spans = []
    for before, data in ((head, stderr), (middle, stdout)):
        doc += before.encode()
        start = len(doc)
        pieces = json_string(data)
        most = JSON_PER_BYTE * min(PIECE, len(data)) + 2  # the largest piece it can be
        while True:
            await hold.reserve(most)
            piece = await anext(pieces, None)
            hold.give(most - (len(piece) if piece is not None else 0))
            if piece is None:
                break
            doc += piece
        spans.append(slice(start, len(doc)))
    doc += tail.encode()
    hold.take(len(head) + len(middle) + len(tail))  # (ASCII: the other fields)
    hold.give(len(stdout) + len(stderr))
    return Observation(doc, meta, stdout=spans[1], stderr=spans[0])
