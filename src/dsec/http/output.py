"""Exec output on the wire, made from bytes as it is written.

A command's output is held as the bytes it wrote; on the wire it is a JSON string: the bytes
read as UTF-8, U+FFFD for each byte that is not (`bytes.decode(errors="replace")`), escaped as
`json.dumps(..., ensure_ascii=False)` escapes. Made whole, that text costs several times the
output (a str, its escaped form, its UTF-8), most for invalid UTF-8; here it is made piece by
piece (`PIECE` bytes of output at a time, an incremental decoder carrying a character split
between pieces), large outputs off the event loop, and written as it is made.

`HeldReply` is an `ExecReply` whose body is pieces already made (a buffer the edge holds);
`BodyResponse` writes any piece source with backpressure (each write waits for the client:
a reader that stops for `STALL_S` is cut off, so nothing held waits on it for ever) and
releases the source when done."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

from starlette.responses import Response

from dsec import models as wire
from dsec.aio import wait_for
from dsec.edgeapi import ExecReply

PIECE = 256 * 1024  # output bytes encoded at a time
# The most JSON text one byte of output becomes: a control character is \\u00XX.
JSON_PER_BYTE = 6
STALL_S = 120.0  # a reader that takes nothing for this long is cut off
META_HEADER = "x-dsec-exec"  # an exec answer's fields but the output, for the apiserver's metrics


def _decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")("replace")


def _escaped(text: str) -> bytes:
    """JSON string content (no quotes) of `text`, UTF-8."""
    return encode_basestring(text)[1:-1].encode()  # type: ignore[no-any-return]


def json_text(data: bytes | bytearray | memoryview) -> bytes:
    """The whole JSON string (quotes included) of `data`: for small outputs."""
    return encode_basestring(bytes(data).decode(errors="replace")).encode()  # type: ignore[no-any-return]


def _piece(decoder: codecs.IncrementalDecoder, data: memoryview, final: bool) -> bytes:
    return _escaped(decoder.decode(data, final))


async def json_string(data: bytes | bytearray | memoryview) -> AsyncIterator[bytes]:
    """The JSON string of `data` (quotes included) in pieces of at most `PIECE` *
    `JSON_PER_BYTE` bytes; all but small outputs are encoded on a worker thread."""
    if len(data) <= PIECE:
        yield json_text(data)
        return
    view = memoryview(data)
    decoder = _decoder()
    loop = asyncio.get_running_loop()
    yield b'"'
    for at in range(0, len(view), PIECE):
        final = at + PIECE >= len(view)
        yield await loop.run_in_executor(None, _piece, decoder, view[at : at + PIECE], final)
    yield b'"'


class StreamText:
    """Server-sent events of output as it comes (`event: stdout`, data: a JSON string), one
    decoder per stream, so a character split between two reads is one character."""

    def __init__(self) -> None:
        self._decoders: dict[str, codecs.IncrementalDecoder] = {}

    def event(self, kind: str, chunk: bytes, final: bool = False) -> bytes:
        decoder = self._decoders.get(kind)
        if decoder is None:
            decoder = self._decoders[kind] = _decoder()
        text = decoder.decode(chunk, final)
        if not text:
            return b""
        return b"event: " + kind.encode() + b'\ndata: "' + _escaped(text) + b'"\n\n'

    def flush(self) -> bytes:
        """What is left of a character cut short at the end of each stream (U+FFFD)."""
        return b"".join(self.event(kind, b"", True) for kind in list(self._decoders))


async def result_json(
    meta: wire.ExecResult, stdout: bytes | bytearray, stderr: bytes | bytearray
) -> AsyncIterator[bytes]:
    """The JSON of the ExecResult `meta` with this output, in pieces (the output never whole)."""
    yield b'{"stdout":'
    async for piece in json_string(stdout):
        yield piece
    yield b',"stderr":'
    async for piece in json_string(stderr):
        yield piece
    yield b"," + meta_rest(meta)


def meta_rest(meta: wire.ExecResult) -> bytes:
    """`meta`'s JSON without its output and opening brace: what follows the output."""
    return meta.model_dump_json(exclude={"stdout", "stderr"})[1:].encode()


class HeldReply(ExecReply):
    """An answer whose body is pieces already made (views of a buffer the edge holds);
    `release` runs once, at `aclose` (what the buffer cost is given back)."""

    def __init__(
        self, meta: wire.ExecResult, parts: Iterable[bytes | memoryview], release: Callable[[], None]
    ) -> None:
        self.meta = meta
        self._parts = list(parts)
        self.length = self._size = sum(len(p) for p in self._parts)
        self._release: Callable[[], None] | None = release

    async def body(self) -> AsyncIterator[bytes]:
        if self._size <= PIECE:  # (most answers: one piece, one write)
            yield b"".join(self._parts)
            return
        for part in self._parts:
            for at in range(0, len(part), PIECE):
                yield bytes(part[at : at + PIECE])

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        self._parts = []
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:  # an answer dropped unsent still gives back what it held
        self.close()


class BodyResponse(Response):
    """A response whose body comes from `pieces`, written with backpressure (see the module);
    `done` runs however the response ends (sent, cut off, or failed)."""

    def __init__(
        self,
        pieces: AsyncIterator[bytes],
        *,
        media_type: str,
        length: int | None = None,
        headers: dict[str, str] | None = None,
        done: Callable[[], Awaitable[None]] | None = None,
        idle: bool = False,
    ) -> None:
        super().__init__(None, media_type=media_type, headers=headers)
        if length is not None:
            self.headers["content-length"] = str(length)
        else:
            del self.headers["content-length"]
        self._pieces = pieces
        self._done = done
        self._small = length is not None and length <= PIECE  # one write: nothing to wait for
        self._idle = idle  # its pieces may wait on something that never comes (a stream's)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            if not self._idle:  # (a client gone: the rest is written nowhere, at once)
                await self._write(send)
                return
            # A client that goes away ends the body at once: its pieces may be waiting on a
            # command that writes nothing more (a stream's place and budget are given back).
            writing = asyncio.ensure_future(self._write(send))
            gone = asyncio.ensure_future(_disconnect(receive))
            try:
                await asyncio.wait((writing, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (writing, gone):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if writing.done() and not writing.cancelled():
                writing.result()
        finally:
            with contextlib.suppress(Exception):
                await self._pieces.aclose()  # type: ignore[attr-defined]
            if self._done is not None:
                await self._done()

    async def _write(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self._small:  # one piece: one write, the body's end with it
            await _send(send, b"".join([piece async for piece in self._pieces]), more=False)
            return
        async for piece in self._pieces:  # each as it comes (a stream's events must not wait)
            if piece:
                await _send(send, piece, more=True)
        await _send(send, b"", more=False)


async def _disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send(send: Any, piece: bytes, *, more: bool) -> None:
    """One piece of a body; it waits while the client's connection is full, `STALL_S` at most."""
    await wait_for(send({"type": "http.response.body", "body": piece, "more_body": more}), STALL_S)


def meta_header(meta: wire.ExecResult) -> str:
    return meta.model_dump_json(exclude={"stdout", "stderr"})


def meta_from_header(value: str) -> wire.ExecResult:
    return wire.ExecResult(stdout="", stderr="", **json.loads(value))


def reply_response(reply: ExecReply) -> BodyResponse:
    """An exec's answer as the HTTP response that writes it (the meta header for an apiserver
    in front of this edge: it reads the limit hits without the body)."""
    return BodyResponse(
        reply.body(),
        media_type="application/json",
        length=reply.length,
        headers={META_HEADER: meta_header(reply.meta)},
        done=reply.aclose,
    )
