"""The kernel interfaces: setns for one thread, libnftables through ctypes, a thread that works
inside other network namespaces, sockets made in a namespace, helper programs."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import logging
import os
import select
import socket
import threading
from collections.abc import Callable, Sequence

from dsec.isolation.netpolicy.limits import CLONE_NEWNET, T
from dsec.isolation.procs import spawn_quick, wait_quick

log = logging.getLogger("dsec.netpolicy")

# --------------------------------------------------------------------------- syscalls, libnftables

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """setns(2) for the calling thread only; `fd` may be a namespace file or a pidfd.
    (Looked up at call time.)"""
    if _libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NftError(RuntimeError):
    pass


class _LibNft:
    """The few libnftables calls we need: run a script (one transaction), get its output."""

    NFT_CTX_OUTPUT_JSON = 1 << 4

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise NftError("libnftables is missing: install the apt package nftables") from e
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        for f in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
        for f in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
            getattr(lib, f).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self.lib = lib

    def run(self, script: str, *, json_output: bool = False) -> str:
        """Run `script` in the calling thread's network namespace (the context's netlink
        socket is opened here, so a context is made per call)."""
        lib = self.lib
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("nft_ctx_new failed")
        try:
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            if json_output:
                lib.nft_ctx_output_set_flags(ctx, self.NFT_CTX_OUTPUT_JSON)
            rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            if rc != 0:
                err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
                raise NftError(err.strip() or f"nft failed ({rc})")
            return out
        finally:
            lib.nft_ctx_free(ctx)


class NetnsWorker:
    """One thread that runs calls inside other network namespaces, one at a time.

    setns(2) changes only the calling thread, so the event loop's thread never moves;
    this thread enters the target (a namespace file or a pidfd) per call and always goes
    back to the namespace it started in."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsec-netns")
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._nft: _LibNft | None = None

    def _enter(self, ns_fd: int | None, fn: Callable[[], T]) -> T:
        if ns_fd is None:
            return fn()
        setns(ns_fd)
        try:
            return fn()
        finally:
            try:
                setns(self._home)
            except OSError:  # never run another call in a foreign namespace
                log.critical("could not return the netns worker to the host namespace")
                os._exit(70)

    async def call(self, ns_fd: int | None, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._enter, ns_fd, fn)

    async def nft(self, ns_fd: int | None, script: str, *, json_output: bool = False) -> str:
        if self._nft is None:
            self._nft = _LibNft()
        nft = self._nft
        return await self.call(ns_fd, lambda: nft.run(script, json_output=json_output))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._home >= 0:
            os.close(self._home)
            self._home = -1


def socket_in_netns(ns_path: str, family: int, kind: int) -> socket.socket:
    """A socket that belongs to another network namespace (a socket keeps the namespace
    it was made in, whichever thread uses it later)."""
    box: list[socket.socket] = []
    errs: list[BaseException] = []

    def make() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns(fd)
            finally:
                os.close(fd)
            box.append(socket.socket(family, kind))
        except BaseException as e:
            errs.append(e)

    t = threading.Thread(target=make, name="dsec-netns-socket")  # the thread dies in that netns
    t.start()
    t.join()
    if errs:
        raise errs[0]
    return box[0]


async def run_tool(argv: Sequence[str], stdin: str = "") -> tuple[int, str]:
    """Run a helper (posix_spawn + pidfd, like the container backend) feeding `stdin`;
    (exit code, stderr+stdout)."""
    rfd, wfd = os.pipe()
    ofd, efd = os.pipe()
    try:
        os.write(wfd, stdin.encode())  # small scripts: they fit in the pipe buffer
        os.close(wfd)
        wfd = -1
        pid, pidfd = spawn_quick(argv, efd, efd, stdin_fd=rfd)
        os.close(efd)
        efd = -1
        rc = await wait_quick(pid, pidfd)
        out = b""
        while select.select([ofd], [], [], 0)[0]:
            chunk = os.read(ofd, 65536)
            if not chunk:
                break
            out += chunk
        return rc, out.decode(errors="replace").strip()
    finally:
        for fd in (rfd, wfd, ofd, efd):
            if fd >= 0:
                os.close(fd)
