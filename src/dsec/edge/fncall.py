"""The fncall backend at the edge: stateless calls served by warm worker sandboxes.

Each worker is a sandbox of a language image (default `code`) running the resident
runner (dsec/fncall/runner.py) as its init's child. The edge and the runner talk over
an AF_UNIX stream socketpair: the edge keeps one end, the runner's end is its fd 0
(close-on-exec in the runner, closed in every process of a call, so no code of a
call can write to it). A call:

1. takes an idle worker of the caller's project, or a fresh one (tagged with the
   project from then on: a worker never serves two projects; with the per-image cap
   reached, an idle worker of another project is retired for a fresh one);
2. creates the call's own cgroup under the worker sandbox and sends one JSON line
   with a per-call id and that cgroup's cgroup.procs attached (SCM_RIGHTS); the
   runner's child joins it before anything of the call runs;
3. waits for exactly one line echoing that id (anything else, bytes before or after
   it, or bytes with no call pending: the worker is retired and replaced);
4. removes the call's cgroup (pids.max=0, SIGKILL until empty, rmdir); only a worker
   whose call left nothing alive serves again, any other is replaced.

A worker whose runner died or that reports itself unhealthy (the code broke its
sandbox) is replaced in the background. No per-call provisioning.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from dsec import errors
from dsec.aio import wait_for
from dsec.backends.base import SandboxHandle
from dsec.backends.shim import Launch
from dsec.edge.process import PipeReader, Spawned, spawn
from dsec.fncall import languages
from dsec.fncall.tier import container_only
from dsec.isolation.cgroups import CgroupHost, ExecGroup
from dsec.models import (
    WORKER_BACKEND,
    FnCallRequest,
    FnCallResult,
    JupyterRequest,
    JupyterResult,
    SandboxInfo,
    SandboxSpec,
    Stage,
)


@dataclass(frozen=True)
class WorkerHost:
    """What the pool needs of its edge, and nothing more: make and stop worker sandboxes,
    reach a worker's sandbox, the host's cgroups, and whether an image exists."""

    create: Callable[[SandboxSpec], Awaitable[SandboxInfo]]
    stop: Callable[[str], Awaitable[object]]  # without waiting for the teardown
    handle: Callable[[str], SandboxHandle]
    cgroups: CgroupHost
    check_image: Callable[[str], object]  # raises ImageNotFound


log = logging.getLogger("dsec.fncall")
FNCALL_PROJECT = "_fncall"
MiB = 1024 * 1024
REPLY_CAP = 320 * MiB  # a reply holds up to 2 x 64 MiB of output and the fetched files (base64)
ACQUIRE_TIMEOUT_S = 60.0


def runner_source() -> str:
    return resources.files("dsec.fncall").joinpath("runner.py").read_text()


class WorkerLost(Exception):
    pass


@dataclass(eq=False)
class Worker:
    sandbox_id: str
    container_id: str
    proc: Spawned
    sock: socket.socket  # the edge's end of the control channel (non-blocking)
    err: PipeReader
    project: str | None = None  # None: fresh, has served nobody
    broken: str | None = None  # why this worker must not serve again
    buf: bytearray = field(default_factory=bytearray)
    pending: asyncio.Future[bytes] | None = None
    calls: int = 0
    on_broken: Callable[[Worker], None] | None = None  # the pool retires it if it is idle

    def __post_init__(self) -> None:
        self.sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
        self.err.close()
        self._fail("the worker was closed")

    def _fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            if self.on_broken is not None:
                self._loop.call_soon(self.on_broken, self)
        fut, self.pending = self.pending, None
        if fut is not None and not fut.done():
            fut.set_exception(WorkerLost(self.broken))
            fut.exception()  # retrieved: the caller may have gone already

    def _readable(self) -> None:
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                chunk = b""
                log.warning("fncall worker %s: reading its channel failed: %s", self.sandbox_id, e)
            if not chunk:
                self._loop.remove_reader(self.sock.fileno())
                self._fail("the runner exited")
                return
            if self.pending is None or self.broken is not None:
                self._fail(f"the runner wrote {len(chunk)} bytes with no request pending")
                continue
            start = len(self.buf)
            self.buf += chunk
            if len(self.buf) > REPLY_CAP:
                self._fail("the runner's reply exceeds its cap")
                continue
            end = self.buf.find(b"\n", start)
            if end < 0:
                continue
            if end != len(self.buf) - 1:
                self._fail("the runner wrote more than one line for one request")
                continue
            line = bytes(self.buf[:end])
            self.buf.clear()
            fut, self.pending = self.pending, None
            if not fut.done():
                fut.set_result(line)

    def _expect(self) -> asyncio.Future[bytes]:
        """Arm the reader for one line (before anything is sent: no byte may come first)."""
        self.buf.clear()
        fut: asyncio.Future[bytes] = self._loop.create_future()
        self.pending = fut
        return fut

    async def _line(self, fut: asyncio.Future[bytes], timeout: float) -> bytes:
        try:
            return await wait_for(fut, timeout)
        except TimeoutError:
            self._fail("the runner did not answer in time")
            raise WorkerLost(self.broken or "") from None
        except WorkerLost:
            raise
        except BaseException:
            self._fail("a call was abandoned midway")
            raise
        finally:
            if self.pending is fut:
                self.pending = None

    async def wait_ready(self, timeout: float) -> bool:
        try:
            line = await self._line(self._expect(), timeout)
            return bool(json.loads(line).get("ready") is True)
        except (WorkerLost, ValueError, AttributeError):
            return False

    async def request(self, payload: dict[str, Any], cgroup_fd: int, timeout: float) -> dict[str, Any]:
        """One call: the line out with the call's cgroup attached, one line back with its id."""
        if self.broken is not None:
            raise WorkerLost(self.broken)
        call_id = secrets.token_hex(16)
        data = json.dumps({**payload, "id": call_id}).encode() + b"\n"
        fut = self._expect()
        try:
            # The socket's send buffer is empty between calls: the first part goes at once.
            sent = socket.send_fds(self.sock, [data[:65536]], [cgroup_fd])
            if sent < len(data):
                await self._loop.sock_sendall(self.sock, memoryview(data)[sent:])
        except OSError as e:
            self._fail(f"sending to the runner failed: {e}")
            raise WorkerLost(self.broken or "") from e
        except BaseException:
            self._fail("a call was abandoned midway")
            raise
        line = await self._line(fut, timeout)
        try:
            reply = json.loads(line)
        except ValueError as e:
            self._fail("the runner's reply is not JSON")
            raise WorkerLost(self.broken or "") from e
        if not isinstance(reply, dict) or reply.get("id") != call_id:
            self._fail("the runner's reply does not carry the call's id")
            raise WorkerLost(self.broken or "")
        self.err.buf.clear()
        return reply


@dataclass
class _Image:
    """The workers of one image: live (busy or idle), idle by project, callers waiting."""

    workers: list[Worker] = field(default_factory=list)
    idle: dict[str | None, deque[Worker]] = field(default_factory=dict)
    waiting: deque[tuple[str, asyncio.Future[Worker]]] = field(default_factory=deque)
    starting: int = 0
    failures: int = 0  # worker starts failed in a row


class FnCallPool:
    def __init__(self, host: WorkerHost, *, workers_per_image: int = 4) -> None:
        self.host = host
        self.size = workers_per_image
        self.images: dict[str, _Image] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._seq = itertools.count(1)
        self._closed = False

    @property
    def workers(self) -> dict[str, list[Worker]]:
        """Every live worker by image."""
        return {image: im.workers for image, im in self.images.items()}

    async def close(self) -> None:
        self._closed = True
        for t in list(self._starting.values()) + list(self._tasks):
            t.cancel()
        for im in self.images.values():
            for w in im.workers:
                w.close()
            for _, fut in im.waiting:
                if not fut.done():
                    fut.set_exception(errors.Unavailable("the edge is closing"))
        self.images.clear()

    def start(self, image: str) -> asyncio.Task[None]:
        """Bring an image's workers up (idempotent); returns the task doing it."""
        task = self._starting.get(image)
        if task is None:
            self.images.setdefault(image, _Image())
            task = asyncio.create_task(self._fill(image), name=f"dsec-fncall-{image}")
            self._starting[image] = task
        return task

    async def _fill(self, image: str) -> None:
        im = self.images[image]
        im.starting += self.size
        results = await asyncio.gather(
            *(self._new_worker(image) for _ in range(self.size)), return_exceptions=True
        )
        im.starting -= self.size
        for r in results:
            if isinstance(r, Worker):
                self._offer_fresh(image, r)
            else:
                log.warning("fncall worker for %s failed to start: %s", image, r)
        if not im.workers:
            self._fail_waiters(im)

    # --- handing workers out -------------------------------------------------------

    def _offer_fresh(self, image: str, w: Worker) -> None:
        """A fresh worker is up: to the first caller waiting, else idle."""
        im = self.images.get(image)
        if im is None or self._closed:
            w.close()
            self._stop_later(w)
            return
        im.failures = 0
        im.workers.append(w)
        w.on_broken = lambda w: self._retire_if_idle(image, w)
        while im.waiting:
            project, fut = im.waiting.popleft()
            if not fut.done():
                w.project = project
                fut.set_result(w)
                return
        im.idle.setdefault(None, deque()).append(w)

    def _release(self, image: str, w: Worker) -> None:
        """A worker whose call ended cleanly: to a caller of its project, else idle; when
        only callers of other projects wait, it is retired for a fresh worker."""
        im = self.images.get(image)
        if im is None or w not in im.workers:
            return
        for i, (project, fut) in enumerate(im.waiting):
            if project == w.project and not fut.done():
                del im.waiting[i]
                fut.set_result(w)
                return
        if sum(1 for _, fut in im.waiting if not fut.done()) > im.starting:
            self._retire(image, w, "another project needs a worker")
            return
        im.idle.setdefault(w.project, deque()).append(w)

    def _retire_if_idle(self, image: str, w: Worker) -> None:
        """A worker said something unexpected: out at once if idle (a busy one is retired
        by its call)."""
        im = self.images.get(image)
        if im is not None and any(w in q for q in im.idle.values()):
            self._retire(image, w, w.broken or "unexpected bytes on its channel")

    def _retire(self, image: str, w: Worker, why: str) -> None:
        """Stop a worker and start a fresh one in its place."""
        im = self.images.get(image)
        if im is None or w not in im.workers:
            w.close()
            return
        im.workers.remove(w)
        for q in im.idle.values():
            with contextlib.suppress(ValueError):
                q.remove(w)
        log.debug("fncall worker %s retired: %s", w.sandbox_id, why)
        w.close()
        self._stop_later(w)
        self._grow(image)

    def _grow(self, image: str) -> None:
        im = self.images.get(image)
        if im is None or self._closed or len(im.workers) + im.starting >= self.size:
            return
        im.starting += 1
        self._background(self._start_one(image))

    async def _start_one(self, image: str) -> None:
        im = self.images[image]
        try:
            w = await self._new_worker(image)
        except Exception as e:
            log.warning("starting a fncall worker for %s failed: %s", image, e)
            im.failures += 1
            im.starting -= 1
            if im.failures >= 3 and not im.workers:
                self._fail_waiters(im)
            elif im.waiting:
                await asyncio.sleep(min(5.0, 0.2 * im.failures))
                self._grow(image)
            return
        im.starting -= 1
        self._offer_fresh(image, w)

    def _fail_waiters(self, im: _Image) -> None:
        while im.waiting:
            _, fut = im.waiting.popleft()
            if not fut.done():
                fut.set_exception(errors.Unavailable("no fncall worker could start; see the edge log"))

    async def _acquire(self, image: str, project: str) -> Worker:
        im = self.images[image]
        for key in (project, None):
            q = im.idle.get(key)
            while q:
                w = q.popleft()
                if w.broken is not None:
                    self._retire(image, w, w.broken)
                    continue
                w.project = project
                return w
        if not im.workers and not im.starting:
            raise errors.Unavailable(f"no fncall worker for {image!r} could start; see the edge log")
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        im.waiting.append((project, fut))
        if len(im.workers) + im.starting < self.size:
            self._grow(image)
        else:
            # At the cap: the longest-idle worker of another project makes room.
            others = [q for key, q in im.idle.items() if key != project and q]
            if others:
                self._retire(image, others[0][0], "another project needs a worker")
        try:
            return await wait_for(fut, ACQUIRE_TIMEOUT_S)
        except TimeoutError:
            raise errors.Unavailable(
                f"every fncall worker for {image!r} stayed busy for {ACQUIRE_TIMEOUT_S:.0f} s; retry later"
            ) from None
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(image, fut.result())  # handed over just as the caller left
            raise
        finally:
            with contextlib.suppress(ValueError):
                im.waiting.remove((project, fut))

    # --- workers -------------------------------------------------------------------

    def _background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _stop_later(self, w: Worker) -> None:
        async def stop() -> None:
            with contextlib.suppress(errors.DsecError):
                await self.host.stop(w.sandbox_id)

        self._background(stop())

    async def _new_worker(self, image: str) -> Worker:
        spec = SandboxSpec(
            image=image,
            cpu=2,
            memory_mb=2048,
            pids=2048,
            disk_mb=2048,
            storage="memory",  # short, write-light calls in a scratch dir each: no disk to make
            project=FNCALL_PROJECT,
            backend=WORKER_BACKEND,  # the default, stated: the pool relies on host cgroups per call
        )
        info = await self.host.create(spec)
        try:
            return await self._start_runner(info.id)
        except BaseException:
            await self.host.stop(info.id)
            raise

    async def _start_runner(self, sandbox_id: str) -> Worker:
        handle = self.host.handle(sandbox_id)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs_fd = theirs.detach()
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": "/root",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        try:
            proc = await spawn(
                handle,
                self.host.cgroups,
                f"dsec-fncall-{sandbox_id[-6:]}",
                Launch(["python3", "-u", "-c", runner_source()], env, cwd="/", uid=0, gid=0),
                stdio=(theirs_fd, err_w, err_w),
            )
        except BaseException:
            ours.close()
            os.close(err_r)
            raise
        w = Worker(sandbox_id, handle.id, proc, ours, PipeReader(err_r, 64 * 1024))
        if not await w.wait_ready(30.0):
            w.close()
            raise errors.InternalError(
                f"the fncall runner in {sandbox_id} did not start: {w.err.buf[-500:]!r}"
            )
        return w

    # --- the call's cgroup -----------------------------------------------------------

    def _open_call_group(self, w: Worker) -> ExecGroup | None:
        try:
            return self.host.cgroups.open_exec_group(w.container_id, f"fncall-call-{next(self._seq)}")
        except OSError as e:
            log.warning("fncall worker %s: cannot create a call's cgroup: %s", w.sandbox_id, e)
            return None

    @staticmethod
    def _remove_call_group(group: ExecGroup) -> bool:
        """Remove the call's cgroup if the call left nothing alive in it: True when it is gone
        (a cgroup with a task in it cannot be removed, so nothing of the call lives)."""
        group.close_fd()
        try:
            group.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    @staticmethod
    async def _kill_call_group(group: ExecGroup) -> bool:
        """Kill everything of the call (pids.max=0, so nothing forks any more, then SIGKILL
        until empty) and remove its cgroup; True when it is gone."""

        def kill_and_remove() -> bool:
            group.kill()
            with contextlib.suppress(OSError):
                group.remove()
            return not group.path.exists()

        return await asyncio.get_running_loop().run_in_executor(None, kill_and_remove)

    # --- calls -----------------------------------------------------------------------

    async def _call(
        self, image: str, project: str, payload: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], str]:
        self.host.check_image(image)  # ImageNotFound before waiting for workers
        await asyncio.shield(self.start(image))
        for _ in range(3):  # a worker found broken is replaced and the call goes to another
            w = await self._acquire(image, project)
            w.calls += 1
            group = self._open_call_group(w)
            if group is None:
                self._retire(image, w, "its call cgroup could not be created")
                continue
            try:
                try:
                    reply = await w.request(payload, group.procs_fd, timeout)
                finally:
                    clean = self._remove_call_group(group)  # the common case: nothing left
                    if not clean:
                        clean = await asyncio.shield(self._kill_call_group(group))
                    if not clean:
                        w.broken = w.broken or "processes of a call outlived its cgroup's kill"
            except WorkerLost as e:
                self._retire(image, w, str(e))
                raise _Broken(str(e)) from e
            except BaseException as e:
                self._retire(image, w, f"the call failed: {e!r}")  # cancelled mid-call: state unknown
                raise
            if reply.get("healthy") is False or w.broken is not None:
                self._retire(image, w, w.broken or "the runner reported its sandbox unhealthy")
                if reply.get("error_kind") == "runner":
                    continue  # the sandbox was broken before this call: retry elsewhere
            else:
                self._release(image, w)
            if reply.get("error_kind") == "unsupported_language":
                raise errors.InvalidRequest(str(reply["error"]))
            if reply.get("error"):
                raise errors.InternalError(str(reply["error"]))
            return reply, w.sandbox_id
        raise errors.Unavailable(f"fncall workers for {image!r} keep failing; see the edge log")

    async def run(self, req: FnCallRequest) -> FnCallResult:
        container_only(req.backend)  # the apiserver refused it already; a worker is a container
        plan = languages.plan(req.language, req.code, list(req.files), req.compile_timeout)
        if "error" in plan:  # SandboxFusion's answer for code that cannot compile at all
            failed = Stage(status="Error", return_code=1, stderr=plan["error"])
            return FnCallResult(compile=failed, run=None, worker="")
        payload = {**req.model_dump(exclude={"image", "project", "backend"}), **plan, "op": "run"}
        try:
            reply, worker = await self._call(
                req.image, req.project or "", payload, plan["compile_timeout"] + req.run_timeout + 10
            )
        except _Broken:
            # The code killed or wedged the runner: a failed run, not a platform error.
            return FnCallResult(run=Stage(status="Error", stderr="the program killed its runner"), worker="")
        return FnCallResult(
            compile=reply.get("compile"), run=reply.get("run"), files=reply.get("files") or {}, worker=worker
        )

    async def jupyter(self, req: JupyterRequest) -> JupyterResult:
        container_only(req.backend)  # the apiserver refused it already; a worker is a container
        payload = req.model_dump(exclude={"image", "project", "backend"})
        payload["op"] = "jupyter"
        try:
            reply, worker = await self._call(req.image, req.project or "", payload, req.total_timeout + 10)
        except _Broken:
            return JupyterResult(
                driver=Stage(status="Error", stderr="the code killed its runner"), cells=None, worker=""
            )
        return JupyterResult(
            driver=reply.get("driver"),
            cells=reply.get("cells"),
            files=reply.get("files") or {},
            worker=worker,
        )


class _Broken(Exception):
    pass
