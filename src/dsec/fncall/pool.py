"""The fncall backend at the edge: stateless calls served by warm worker sandboxes.

Each worker is a sandbox of a language image (default `code`) running the resident
runner (dsec/fncall/runner.py) as its init's child. A call takes an idle worker,
sends one JSON line, waits for one JSON line, and gives the worker back; a worker
whose runner died or that reports itself unhealthy (the code broke its sandbox)
is replaced in the background. No per-call provisioning.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from dsec import errors
from dsec.edge.process import PipeReader, Spawned, spawn
from dsec.fncall.models import FnCallRequest, FnCallResult, JupyterRequest, JupyterResult, Stage

if TYPE_CHECKING:
    from dsec.edge.edge import Edge

log = logging.getLogger("dsec.fncall")
FNCALL_PROJECT = "_fncall"
MiB = 1024 * 1024


def runner_source() -> str:
    return resources.files("dsec.fncall").joinpath("runner.py").read_text()


@dataclass
class Worker:
    sandbox_id: str
    proc: Spawned
    stdin_fd: int
    out: PipeReader
    err: PipeReader

    def close(self) -> None:
        if self.stdin_fd >= 0:
            os.close(self.stdin_fd)
            self.stdin_fd = -1
        self.out.close()
        self.err.close()

    async def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.out.buf.clear()
        data = json.dumps(payload).encode() + b"\n"
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.stdin_fd, view)
            except BlockingIOError:
                await asyncio.sleep(0.0005)
                continue
            except BrokenPipeError as e:
                raise WorkerLost("the runner is gone") from e
            view = view[n:]
        end = time.monotonic() + timeout
        while not self.out.buf.endswith(b"\n"):
            if self.out.fd < 0:
                raise WorkerLost("the runner exited")
            self.out.changed.clear()
            left = end - time.monotonic()
            if left <= 0:
                raise WorkerLost("the runner did not answer in time")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.out.changed.wait(), left)
        reply: dict[str, Any] = json.loads(bytes(self.out.buf))
        self.out.buf.clear()
        self.err.buf.clear()
        return reply


class WorkerLost(Exception):
    pass


class FnCallPool:
    def __init__(self, edge: Edge, *, workers_per_image: int = 4) -> None:
        self.edge = edge
        self.size = workers_per_image
        self.idle: dict[str, asyncio.Queue[Worker]] = {}
        self.workers: dict[str, list[Worker]] = {}
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        for t in list(self._starting.values()) + list(self._tasks):
            t.cancel()
        for ws in self.workers.values():
            for w in ws:
                w.close()
        self.workers.clear()
        self.idle.clear()

    def start(self, image: str) -> asyncio.Task[None]:
        """Bring an image's workers up (idempotent); returns the task doing it."""
        task = self._starting.get(image)
        if task is None:
            self.idle.setdefault(image, asyncio.Queue())
            self.workers.setdefault(image, [])
            task = asyncio.create_task(self._fill(image), name=f"dsec-fncall-{image}")
            self._starting[image] = task
        return task

    async def _fill(self, image: str) -> None:
        results = await asyncio.gather(
            *(self._new_worker(image) for _ in range(self.size)), return_exceptions=True
        )
        for r in results:
            if isinstance(r, Worker):
                self._add(image, r)
            else:
                log.warning("fncall worker for %s failed to start: %s", image, r)

    def _add(self, image: str, w: Worker) -> None:
        self.workers[image].append(w)
        self.idle[image].put_nowait(w)

    async def _new_worker(self, image: str) -> Worker:
        from dsec.models import SandboxSpec

        spec = SandboxSpec(
            image=image, cpu=2, memory_mb=2048, pids=2048, disk_mb=2048, project=FNCALL_PROJECT
        )
        info = await self.edge.create(spec)
        try:
            return await self._start_runner(info.id)
        except BaseException:
            await self.edge.stop(info.id, wait=False)
            raise

    async def _start_runner(self, sandbox_id: str) -> Worker:
        sb = self.edge.sandboxes[sandbox_id]
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "HOME": "/root",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        try:
            proc = await spawn(
                sb.container,
                self.edge.cgroups,
                f"dsec-fncall-{sandbox_id[-6:]}",
                ["python3", "-u", "-c", runner_source()],
                env,
                cwd="/",
                uid=0,
                gid=0,
                stdio=(in_r, out_w, err_w),
            )
        except BaseException:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        os.set_blocking(in_w, False)
        w = Worker(sandbox_id, proc, in_w, PipeReader(out_r, 256 * MiB), PipeReader(err_r, 64 * 1024))
        if not await _wait_ready(w, 30.0):
            w.close()
            raise errors.InternalError(
                f"the fncall runner in {sandbox_id} did not start: {w.err.buf[-500:]!r}"
            )
        return w

    async def _replace(self, image: str, w: Worker) -> None:
        if image not in self.workers:  # closing
            return
        with contextlib.suppress(ValueError):
            self.workers[image].remove(w)
        w.close()
        with contextlib.suppress(errors.DsecError):
            await self.edge.stop(w.sandbox_id, wait=False)
        try:
            fresh = await self._new_worker(image)
            if image in self.workers:
                self._add(image, fresh)
            else:
                fresh.close()
        except Exception as e:
            log.warning("replacing fncall worker for %s failed: %s", image, e)

    def _replace_later(self, image: str, w: Worker) -> None:
        task = asyncio.create_task(self._replace(image, w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, image: str, payload: dict[str, Any], timeout: float) -> tuple[dict[str, Any], str]:
        self.edge.layers.get_image(image)  # ImageNotFound before waiting for workers
        await asyncio.shield(self.start(image))
        for _ in range(3):  # a worker found broken is replaced and the call goes to another
            if not self.workers.get(image):
                raise errors.Unavailable(f"no fncall worker for {image!r} could start; see the edge log")
            w = await asyncio.wait_for(self.idle[image].get(), 60.0)
            try:
                reply = await w.request(payload, timeout)
            except WorkerLost as e:
                self._replace_later(image, w)
                raise _Broken(str(e)) from e
            except BaseException:
                self._replace_later(image, w)  # cancelled mid-call: its state is unknown
                raise
            if reply.get("healthy") is False:
                self._replace_later(image, w)
                if reply.get("error_kind") == "runner":
                    continue  # the sandbox was broken before this call: retry elsewhere
            else:
                self.idle[image].put_nowait(w)
            if reply.get("error_kind") == "unsupported_language":
                raise errors.InvalidRequest(str(reply["error"]))
            if reply.get("error"):
                raise errors.InternalError(str(reply["error"]))
            return reply, w.sandbox_id
        raise errors.Unavailable(f"fncall workers for {image!r} keep failing; see the edge log")

    async def run(self, req: FnCallRequest) -> FnCallResult:
        payload = req.model_dump(exclude={"image"})
        payload["op"] = "run"
        try:
            reply, worker = await self._call(req.image, payload, req.compile_timeout + req.run_timeout + 10)
        except _Broken:
            # The code killed or wedged the runner: a failed run, not a platform error.
            return FnCallResult(run=Stage(status="Error", stderr="the program killed its runner"), worker="")
        return FnCallResult(
            compile=reply.get("compile"), run=reply.get("run"), files=reply.get("files") or {}, worker=worker
        )

    async def jupyter(self, req: JupyterRequest) -> JupyterResult:
        payload = req.model_dump(exclude={"image"})
        payload["op"] = "jupyter"
        try:
            reply, worker = await self._call(req.image, payload, req.total_timeout + 10)
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


async def _wait_ready(w: Worker, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not w.out.buf.endswith(b"\n"):
        if w.out.fd < 0 or time.monotonic() > end:
            return False
        w.out.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(w.out.changed.wait(), max(0.0, end - time.monotonic()))
    ok = json.loads(bytes(w.out.buf)).get("ready") is True
    w.out.buf.clear()
    return bool(ok)
