"""Persistent sessions: a bash shell or a Python interpreter that keeps its state.

bash: each run is sent as `eval $'<code>' </dev/null` followed by a printf of
a random end marker and `$?`; stdout and stderr share one pipe, so the output
keeps its order. The code is ANSI-C quoted, so no byte of it is ever parsed
by the shell as protocol, and the command's stdin is /dev/null, so it cannot
eat the marker. A timeout kills every process of the session but the shell.

python: a small driver reads one JSON request per line, runs the code in one
namespace (the value of a final expression is printed, as in a REPL) and
answers one JSON line on a private copy of the original stdout; fd 1 and 2 of
the code point at the stderr pipe, so stray subprocess output cannot corrupt
the protocol. A timeout sends SIGINT (KeyboardInterrupt, state kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass, field

from dsec.backends.container import ShimChannel
from dsec.edge.process import PipeReader, Spawned, exit_code, kill_except, release_group
from dsec.errors import InvalidRequest, SessionNotFound
from dsec.models import SessionKind, SessionResult

PY_DRIVER = r"""
import ast, contextlib, io, json, os, signal, sys, traceback
cin = os.fdopen(os.dup(0), "r", encoding="utf-8", newline="\n")
cout = os.fdopen(os.dup(1), "w", encoding="utf-8")
nul = os.open(os.devnull, os.O_RDONLY)
os.dup2(nul, 0); os.close(nul); os.dup2(2, 1)
sys.stdin = open(os.devnull)
sys.stdout = sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
ns = {"__name__": "__main__", "__builtins__": __builtins__}
class Capped(io.TextIOBase):
    # keeps the first `cap` characters, counts the rest: a print flood costs no memory
    def __init__(self, cap):
        self.cap, self.parts, self.kept, self.over = cap, [], 0, False
    def writable(self):
        return True
    def write(self, s):
        room = self.cap - self.kept
        if room > 0:
            self.parts.append(s[:room]); self.kept += min(len(s), room)
        if len(s) > room:
            self.over = True
        return len(s)
    def getvalue(self):
        return "".join(self.parts)
def run(code, out, err):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        tree = ast.parse(code, "<session>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<session>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<session>", "eval"), ns)
            if value is not None:
                print(repr(value))
while True:
    try:
        line = cin.readline()
        if not line:
            break
        req = json.loads(line)
        cap = int(req.get("cap", 1 << 20))
        out, err, error = Capped(cap), Capped(cap), None
        try:
            run(req["code"], out, err)
        except BaseException:
            error = traceback.format_exc()[-cap:]
        reply = {"stdout": out.getvalue(), "stderr": err.getvalue(), "error": error}
        reply["truncated"] = out.over or err.over
        cout.write(json.dumps(reply, ensure_ascii=False) + "\n")
        cout.flush()
    except KeyboardInterrupt:
        cout.write(json.dumps({"stdout": "", "stderr": "", "error": "KeyboardInterrupt"}) + "\n")
        cout.flush()
"""


def ansi_c_quote(code: str) -> str:
    """Quote `code` as a bash $'...' string that decodes back to the same bytes."""
    raw = code.encode()
    if b"\0" in raw:
        raise InvalidRequest("bash session input must not contain NUL bytes")
    safe = set(
        b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-+=.,:/@%^*()[]{}<>|;&~!?#$`"'
    )
    return "$'" + "".join(chr(b) if b in safe else f"\\x{b:02x}" for b in raw) + "'"


@dataclass
class Session:
    id: str
    kind: SessionKind
    proc: Spawned
    root_pid: int
    stdin_fd: int
    out: PipeReader
    err: PipeReader | None
    channel: ShimChannel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created_at: float = field(default_factory=time.time)

    @property
    def alive(self) -> bool:
        return not self.proc.exited.done() and self.stdin_fd >= 0

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.stdin_fd, view)
            except BlockingIOError:
                time.sleep(0.0005)
                continue
            except BrokenPipeError as e:
                raise SessionNotFound(f"session {self.id} has ended; open a new one") from e
            view = view[n:]

    async def run(self, code: str, timeout: float, cap: int) -> SessionResult:
        if not self.alive:
            raise SessionNotFound(f"session {self.id} has ended; open a new one")
        async with self.lock:
            if self.kind is SessionKind.BASH:
                return await self._run_bash(code, timeout, cap)
            return await self._run_python(code, timeout, cap)

    async def _wait_for(self, reader: PipeReader, predicate: object, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not predicate():  # type: ignore[operator]
            if reader.fd < 0:
                return False
            reader.changed.clear()
            left = end - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader.changed.wait(), left)
        return True

    async def _run_bash(self, code: str, timeout: float, cap: int) -> SessionResult:
        t0 = time.perf_counter()
        marker = f"__DSEC_END_{secrets.token_hex(8)}__"
        self.out.buf.clear()
        self.out.truncated = False
        self.out.cap = max(cap, 0) + len(marker) + 64
        self.out.tail_cap = len(marker) + 64  # past a flood, the end marker is in the tail
        self.out.tail = b""
        self._send(f"eval {ansi_c_quote(code)} </dev/null\nprintf '\\n{marker}%d\\n' $?\n".encode())
        token = marker.encode()

        def end() -> bytes:  # the stream's last bytes, wherever the cap cut it
            return bytes(self.out.buf[-self.out.tail_cap :]) + self.out.tail if self.out.tail else b""

        def done() -> bool:
            b = end() or self.out.buf
            return b.rfind(token) >= 0 and b.endswith(b"\n")

        timed_out = False
        if (
            not await self._wait_for(self.out, done, timeout)
            and self.out.fd >= 0
            and not self.proc.exited.done()
        ):
            timed_out = True
            await asyncio.get_running_loop().run_in_executor(
                None, kill_except, self.proc.group, self.root_pid
            )
            await self._wait_for(self.out, done, 5.0)
        tail = end()
        buf = bytes(self.out.buf)
        self.out.tail = b""
        self.out.buf.clear()
        flood = bool(tail) and tail.rfind(token) >= 0  # the output is the first `cap` bytes
        idx = buf.rfind(token)
        if flood:
            rc = int(tail[tail.rfind(token) + len(token) :].split(b"\n", 1)[0] or b"0")
            output, truncated = buf, True
        elif idx < 0:
            # The shell ended (exit, or killed): return what it printed.
            await asyncio.sleep(0)
            status = self.proc.exited.result() if self.proc.exited.done() else None
            rc = exit_code(status) if status is not None else 137
            output, truncated = buf, self.out.truncated
        else:
            output = buf[:idx]
            if output.endswith(b"\n"):
                output = output[:-1]
            rc = int(buf[idx + len(token) :].split(b"\n", 1)[0] or b"0")
            truncated = len(output) > cap or self.out.truncated
        return SessionResult(
            output=output[:cap].decode(errors="replace"),
            exit_code=124 if timed_out and (flood or idx >= 0) else rc,
            duration=time.perf_counter() - t0,
            timed_out=timed_out,
            truncated=truncated,
        )

    async def _run_python(self, code: str, timeout: float, cap: int) -> SessionResult:
        assert self.err is not None
        t0 = time.perf_counter()
        self.out.buf.clear()
        # The driver caps each stream at `cap` characters; JSON escaping makes a character at
        # most 6 bytes. Past that bound the reply is not the driver's (the code took over its
        # pipe): it is cut, and the session reported as broken, never buffered without limit.
        self.out.cap = 6 * 3 * max(cap, 1) + 65536
        self.out.truncated = False
        self.err.buf.clear()
        self.err.truncated = False
        self.err.cap = cap
        self._send(json.dumps({"code": code, "cap": cap}).encode() + b"\n")

        def done() -> bool:
            return self.out.buf.endswith(b"\n")

        timed_out = False
        if not await self._wait_for(self.out, done, timeout) and self.out.fd >= 0:
            timed_out = True
            self.proc_signal(signal.SIGINT)
            if not await self._wait_for(self.out, done, 2.0):
                await asyncio.get_running_loop().run_in_executor(None, self.proc.group.kill)
        self.err.drain()
        line = bytes(self.out.buf)
        self.out.buf.clear()
        stray = self.err.buf.decode(errors="replace")
        if not line.endswith(b"\n"):
            raise SessionNotFound(f"session {self.id} ended while running the code; open a new one")
        reply = json.loads(line)
        stdout: str = reply["stdout"]
        stderr: str = stray + reply["stderr"]
        return SessionResult(
            output=stdout[:cap],
            stderr=stderr[:cap],
            error=reply["error"],
            exit_code=124 if timed_out else (1 if reply["error"] else 0),
            duration=time.perf_counter() - t0,
            timed_out=timed_out,
            truncated=bool(reply.get("truncated"))
            or len(stdout) > cap
            or len(stderr) > cap
            or self.err.truncated,
        )

    def proc_signal(self, sig: int) -> None:
        # The shim signals the session's process group (the driver is its leader).
        self.channel.signal(self.proc.ident, sig)

    def close(self, *, kill: bool = True) -> None:
        """Close our ends; with `kill`, also end the session's processes (not needed
        when the whole sandbox is going away)."""
        if self.stdin_fd >= 0:
            os.close(self.stdin_fd)
            self.stdin_fd = -1
        if kill:
            self.proc.group.kill()
        self.out.close()
        if self.err is not None:
            self.err.close()
        if kill:
            release_group(self.proc.group)


def session_argv(kind: SessionKind) -> list[str]:
    if kind is SessionKind.BASH:
        return ["/bin/bash", "--noprofile", "--norc"]
    return ["python3", "-u", "-c", PY_DRIVER]


def check_kind(kind: str) -> SessionKind:
    try:
        return SessionKind(kind)
    except ValueError as e:
        raise InvalidRequest(f"unknown session kind {kind!r}: use 'bash' or 'python'") from e


__all__ = ["Session", "ansi_c_quote", "check_kind", "session_argv"]
