"""Denied system calls, attributed to sandboxes.

The seccomp profile carries SECCOMP_FILTER_FLAG_LOG: the kernel makes an audit record
(type 1326: session, pid, comm, syscall number) for every call the filter refuses. This
reader takes them from the audit netlink read-only multicast group (every record; /dev/kmsg,
rate-limited by the kernel, is the fallback) without blocking, maps each record
by its audit session id (`ses=`: the launcher of each sandbox sets a login uid, which gives
it and everything it starts a session of its own that nothing inside can change; see
dsec-shim.c), falling back to the process's cgroup, and reports it. The counts are a lower
bound only when a flood overruns the socket buffer (4 MiB). Reading is cheap (only new
records) and `drain()` lets a caller see what its own call just caused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import socket
import struct
from collections.abc import Callable

_RECORD = re.compile(rb" ses=(\d+) .*?pid=(\d+) .*?comm=\"([^\"]*)\".*? syscall=(\d+)")
_NETLINK_AUDIT = 9
_AUDIT_NLGRP_READLOG = 1  # read-only multicast of every audit record (CAP_AUDIT_READ)
_AUDIT_SECCOMP = 1326
_NLMSG = struct.Struct("=IHHII")
_SANDBOX = re.compile(r"/dsec/([a-z0-9]+-[a-z0-9]+)(?:/|$)")

OnDenied = Callable[[str, int, str, int], None]  # (sandbox id, syscall number, comm, host pid)


def sandbox_of(pid: int) -> str | None:
    """The sandbox a host pid belongs to (from its cgroup), or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                m = _SANDBOX.search(line)
                if m:
                    return m.group(1)
    except OSError:
        pass
    return None


def audit_session(pid: int) -> int | None:
    """The audit session id of a process (each sandbox has its own, set by its launcher)."""
    try:
        with open(f"/proc/{pid}/sessionid") as f:
            ses = int(f.read())
    except (OSError, ValueError):
        return None
    return None if ses in (0, 0xFFFFFFFF) else ses


class DeniedSyscalls:
    def __init__(self, on_denied: OnDenied) -> None:
        self.on_denied = on_denied
        self.fd = -1
        self.sock: socket.socket | None = None
        self.sessions: dict[int, str] = {}  # audit session id -> sandbox id

    def start(self) -> bool:
        """Follow the audit records from now on; False when they cannot be read (no counts).

        The audit netlink multicast group gets every record, unthrottled; /dev/kmsg (the
        fallback) only what the kernel prints, which it rate-limits to ~10 per 5 s."""
        loop = asyncio.get_running_loop()
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_AUDIT)
            sock.bind((0, 1 << (_AUDIT_NLGRP_READLOG - 1)))
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.setblocking(False)
            self.sock = sock
            loop.add_reader(sock.fileno(), self.drain)
            return True
        except OSError:
            self.sock = None
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            self.close()
            return False
        loop.add_reader(self.fd, self.drain)
        return True

    def drain(self) -> None:
        """Handle every record received so far."""
        if self.sock is not None:
            self._drain_netlink()
        while self.fd >= 0:
            try:
                rec = os.read(self.fd, 8192)  # one record per read
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten before we read it: go on
                    continue
                return
            if b"type=1326" in rec:
                self._record(rec)

    def _drain_netlink(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # a flood overran the buffer: records were lost
                    continue
                return
            off = 0
            while off + _NLMSG.size <= len(data):
                length, kind = _NLMSG.unpack_from(data, off)[:2]
                if length < _NLMSG.size:
                    break
                if kind == _AUDIT_SECCOMP:
                    self._record(data[off + _NLMSG.size : off + length])
                off += (length + 3) & ~3

    def _record(self, rec: bytes) -> None:
        m = _RECORD.search(rec)
        if m is None:
            return
        pid = int(m.group(2))
        sid = self.sessions.get(int(m.group(1))) or sandbox_of(pid)
        if sid is not None:
            self.on_denied(sid, int(m.group(4)), m.group(3).decode(errors="replace"), pid)

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
