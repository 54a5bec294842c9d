"""Denied system calls, attributed to sandboxes.

The seccomp profile carries SECCOMP_FILTER_FLAG_LOG: the kernel writes an audit record
(type=1326: pid, comm, syscall number) for every call the filter refuses. This reader
follows /dev/kmsg without blocking, maps each record's pid (a host pid) to its sandbox
through /proc/<pid>/cgroup, and reports it. The counts are a lower bound: the kernel
rate-limits that log under a flood, and a process that exits within microseconds of its
refused call is gone before its record is read (all sandboxes share one host uid range, so
nothing else in the record names the sandbox). A process that keeps running (an agent's
interpreter, a tool) is attributed. Reading is cheap (only new records) and `drain()` lets a
caller see what its own call just caused.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
from collections.abc import Callable

_RECORD = re.compile(rb"type=1326 .*? pid=(\d+) .*?comm=\"([^\"]*)\".*? syscall=(\d+)")
_SANDBOX = re.compile(r"/dsec/([a-z0-9]+-[a-z0-9]+)(?:/|$)")

OnDenied = Callable[[str, int, str], None]  # (sandbox id, syscall number, comm)


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


class DeniedSyscalls:
    def __init__(self, on_denied: OnDenied) -> None:
        self.on_denied = on_denied
        self.fd = -1

    def start(self) -> bool:
        """Follow the kernel log from now on; False when it cannot be read (no counts then)."""
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError:
            self.close()
            return False
        asyncio.get_running_loop().add_reader(self.fd, self.drain)
        return True

    def drain(self) -> None:
        """Handle every record written so far."""
        while self.fd >= 0:
            try:
                rec = os.read(self.fd, 8192)  # one record per read
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EPIPE:  # overwritten before we read it: go on
                    continue
                return
            if b"type=1326" not in rec:
                continue
            m = _RECORD.search(rec)
            if m is None:
                continue
            sid = sandbox_of(int(m.group(1)))
            if sid is not None:
                self.on_denied(sid, int(m.group(3)), m.group(2).decode(errors="replace"))

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
