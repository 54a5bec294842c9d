"""GuestChannel against a hostile guest: the peer of the port is code we do not trust once a
guest kernel is compromised, so what it sends must not grow the edge or wedge it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct

import pytest

from dsec.backends.guestchannel import MAX_FRAME, GuestChannel
from dsec.backends.shim import Launch
from dsec.errors import InternalError


async def test_an_oversized_frame_closes_the_channel() -> None:
    host, guest = socket.socketpair()
    ch = GuestChannel(host)
    guest.sendall(struct.pack("<cII", b"O", 1, MAX_FRAME + 1) + b"x" * 4096)
    for _ in range(100):
        if ch.closed:
            break
        await asyncio.sleep(0.01)
    assert ch.closed  # nothing buffered towards a frame it claims is huge
    guest.close()


async def test_forged_answers_for_unknown_processes_are_ignored() -> None:
    host, guest = socket.socketpair()
    ch = GuestChannel(host)
    junk = b"".join(
        struct.pack("<cII", k, 7, 4) + struct.pack("<i", 0) for k in (b"R", b"X", b"F", b"O", b"E", b"p")
    )
    guest.sendall(junk + struct.pack("<cII", b"H", 0, 0))
    await asyncio.wait_for(ch.hello, 2)
    assert not ch.closed
    # and a spawn still works: the guest answers it started, writes output, exits
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    task = asyncio.ensure_future(ch.spawn(Launch(["true"], {}, "/", 0, 0), stdio=(null, out_w, out_w)))
    await asyncio.sleep(0.05)
    os.close(out_w)
    os.close(null)
    guest.setblocking(False)
    sent = b""
    for _ in range(100):
        with contextlib.suppress(BlockingIOError):
            sent += guest.recv(65536)
        if len(sent) >= 9:
            break
        await asyncio.sleep(0.01)
    kind, ident, _ = struct.unpack_from("<cII", sent)
    assert kind == b"S"
    guest.sendall(
        struct.pack("<cII", b"R", ident, 4) + struct.pack("<i", 42)
        + struct.pack("<cII", b"X", ident, 4) + struct.pack("<i", 0)  # before its output: held
        + struct.pack("<cII", b"O", ident, 2) + b"hi"
        + struct.pack("<cII", b"O", ident, 0)
        + struct.pack("<cII", b"E", ident, 0)
    )  # fmt: skip
    _, pid, exited = await asyncio.wait_for(task, 2)
    assert pid == 42
    assert await asyncio.wait_for(exited, 2) == 0
    assert os.read(out_r, 10) == b"hi"  # written before the exit was reported
    os.close(out_r)
    guest.close()
    await asyncio.sleep(0.05)
    assert ch.closed
    with pytest.raises(InternalError):
        await ch.ping(0.1)
