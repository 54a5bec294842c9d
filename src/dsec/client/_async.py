"""The asyncio SDK: :class:`AsyncClient`, :class:`AsyncSandbox`, :class:`AsyncSession`, ``AsyncFiles``."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Unpack

import httpx

from dsec import errors
from dsec.client import _base, _calls, _stream
from dsec.client._base import Call, Request, T
from dsec.client._calls import BurstOptions, SpecOptions, StepArg
from dsec.client._wire import AsyncWire, usable
from dsec.models import (
    BackendInfo,
    Burst,
    Checkpoint,
    EdgeStatus,
    ExecResult,
    FileStat,
    NetworkPolicy,
    SandboxInfo,
    SandboxSpec,
    SessionInfo,
    SessionResult,
    SnapshotInfo,
    Trajectory,
)

log = logging.getLogger("dsec.client")


class AsyncClient(_base.AsyncEndsOnExit):
    """An asyncio connection to dsec. One pooled ``httpx.AsyncClient`` per instance.

    ``url`` / ``token`` default to ``DSEC_URL`` / ``DSEC_TOKEN``, then the config file of
    ``dsec up`` (see :func:`dsec.client.config.resolve`). ``url`` may name several
    apiservers (a list, or ``DSEC_URL=a,b``): a call that cannot connect to one is sent to the
    next; after a call one may have taken fails (its connection cut, an answer that it is
    unavailable), the next call goes to the next one too.
    Idempotent calls are retried ``retries`` times on transient errors; so are creates (each
    carries an idempotency key: one sandbox however often it is sent); exec and session
    runs are not, unless tagged with a step, nor is any other call the server may have taken.
    """

    def __init__(
        self,
        url: str | builtins.list[str] | None = None,
        token: str | None = None,
        *,
        timeout: float = 120.0,
        retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._base = _base.BaseClient(url, token, timeout=timeout, retries=retries)
        self._conns: builtins.list[tuple[httpx.AsyncClient, AsyncWire | None]] = []
        for u in self._base.urls:
            kwargs = self._base._client_kwargs(u)
            # Plain calls take the socket fast path (_wire.py) unless a transport is given.
            wire = (
                AsyncWire(
                    u,
                    kwargs["headers"],
                    max_keepalive=_base.MAX_KEEPALIVE,
                    max_connections=_base.MAX_CONNECTIONS,
                )
                if transport is None and usable(u)
                else None
            )
            self._conns.append((httpx.AsyncClient(transport=transport, **kwargs), wire))
        self._undoing: set[asyncio.Task[None]] = set()  # cancelled creates being undone (create)
        self._closing = False

    UNDO_WAIT_S = 30.0  # how long aclose waits for cancelled creates to be undone

    @property
    def _http(self) -> httpx.AsyncClient:
        return self._conns[self._base.current][0]

    @property
    def _wire(self) -> AsyncWire | None:
        return self._conns[self._base.current][1]

    @property
    def url(self) -> str:
        return self._base.url

    def __repr__(self) -> str:
        return f"AsyncClient(url={self.url!r})"

    # ------------------------------------------------------------------ I/O

    async def _send(self, req: Request, *, stream: bool = False) -> tuple[int, httpx.Response]:
        """Send `req` (see BaseClient._retry_delay for where and how often); the apiserver
        that answered and its success response (`stream`: opened, its body not read)."""
        request_id = self._base._request_id()
        attempt = 0
        while True:
            used = self._base.current
            try:
                response = await self._exchange(used, req, request_id, stream)
            except httpx.TransportError as exc:
                err: errors.DsecError = self._base._unreachable(exc, self._base.urls[used])
                delay = self._base._retry_delay(req, err, attempt, used, sent=_base.delivered(exc))
                if delay is None:
                    raise err from exc
            else:
                if response.is_success:
                    return used, response
                err = self._base._error(response)
                delay = self._base._retry_delay(req, err, attempt, used)
                if delay is None:
                    raise err
            await asyncio.sleep(delay)
            attempt += 1

    async def _exchange(self, used: int, req: Request, request_id: str, stream: bool) -> httpx.Response:
        http, wire = self._conns[used]
        if stream:
            response = await http.send(self._base._build(http, req, request_id), stream=True)
            if not response.is_success:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            return response
        if wire is not None:
            return await wire.request(*self._base._wire_call(wire, req, request_id))
        return await http.send(self._base._build(http, req, request_id))

    async def _call(self, call: Call[T]) -> T:
        return self._base._parse(call, (await self._send(call.request))[1])

    # ------------------------------------------------------------------ sandboxes

    async def create(
        self,
        image: str = "python",
        *,
        snapshot: SnapshotInfo | str | None = None,
        idempotency_key: str | None = None,
        **spec: Unpack[SpecOptions],
    ) -> AsyncSandbox:
        """Create one sandbox. Retried on transient errors, to another apiserver too: it
        carries an idempotency key (`idempotency_key`, else a fresh one per call), so however
        often it is sent it makes one sandbox; pass your own to make a create idempotent
        across calls (a trainer restarted mid-step, say).
        The options are SandboxSpec's (cpu, memory_mb, pids, disk_mb, env, user, workdir,
        labels, ttl_idle_s, ttl_action, project, backend, network, protected_paths...), with
        its defaults.

        `snapshot=` restores a snapshot (what `sb.snapshot()` returned, or its id): the new
        sandbox starts from its files.
        `ttl_action="pause"` makes the idle TTL pause instead of stop. `network=` an egress
        allowlist (``{"allow": [{"to": "pypi.org", "ports": [443]}]}``; none: loopback only).
        `protected_paths=` paths moved out of reach of the sandbox's processes (see verify()).
        `backend=` the backend that runs it (the isolation tier; the default is container).

        Cancelled while in flight (a step deadline, `asyncio.wait_for`), a create without
        `idempotency_key` is undone: the apiserver may still make the sandbox, so the SDK
        sends it again with the same key (which answers with what it made, or makes it now)
        and stops that, in the background; `aclose()` waits for it. With your own key it is
        left to you: send the create again with the key to find it."""
        full = _calls.build_spec(_calls.snapshot_image(snapshot) or image, spec)
        if idempotency_key is not None:
            info = await self._call(_calls.create(full, idempotency_key))
            return AsyncSandbox(self, info.id, info)
        key = _calls.new_idempotency_key()
        try:
            info = await self._call(_calls.create(full, key))
        except asyncio.CancelledError:
            self._undo_create(full, key)
            raise
        return AsyncSandbox(self, info.id, info)

    def _undo_create(self, spec: SandboxSpec, key: str) -> None:
        """Stop what the cancelled create of `key` made (see create)."""
        if self._closing:  # (its connections are going: say what may be left)
            log.warning("a create cancelled as its client closed may have made a sandbox (key %s)", key)
            return

        async def undo() -> None:
            try:
                info = await self._call(_calls.create(spec, key))
                await self._call(_calls.stop(info.id))
            except Exception as e:  # (refused, say: then it made nothing)
                log.warning("undoing a cancelled create (Idempotency-Key %s): %s", key, e)

        task = asyncio.get_running_loop().create_task(undo(), name="dsec-undo-create")
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def create_many(
        self, n: int, image: str = "python", *, concurrency: int = 64, **spec: Unpack[SpecOptions]
    ) -> list[AsyncSandbox]:
        """Create ``n`` sandboxes in batches of up to 256, ``concurrency`` batches at a time.

        All or nothing: if a batch fails, the sandboxes already created are stopped and
        the first error is raised.
        """
        if concurrency < 1:
            raise errors.InvalidRequest(f"concurrency must be >= 1, got {concurrency}")
        full = _calls.build_spec(image, spec)
        chunks = _calls.chunk_sizes(n)
        if not chunks:
            return []
        results: list[list[SandboxInfo]] = [[] for _ in chunks]
        failures: list[BaseException] = []
        semaphore = asyncio.Semaphore(concurrency)

        async def run(index: int) -> None:
            async with semaphore:
                if failures:  # a batch failed: launch no more
                    return
                try:
                    batch = await self._call(_calls.create_batch(chunks[index], full))
                except Exception as exc:
                    failures.append(exc)
                    return
                results[index] = batch.sandboxes
                if batch.errors:
                    failures.append(batch.errors[0])

        try:
            await asyncio.gather(*(run(i) for i in range(len(chunks))))
        except BaseException:  # cancelled: do not leak the sandboxes created so far
            created = [info.id for chunk in results for info in chunk]
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(self.stop_many(created))
            raise
        infos = [info for chunk in results for info in chunk]
        if failures:
            with contextlib.suppress(Exception):
                await self.stop_many([info.id for info in infos])
            raise failures[0]
        return [AsyncSandbox(self, info.id, info) for info in infos]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on an existing sandbox; raises :class:`errors.SandboxNotFound` if there is none."""
        info = await self._call(_calls.get(sandbox_id))
        return AsyncSandbox(self, info.id, info)

    def sandbox(self, sandbox_id: str) -> AsyncSandbox:
        """A handle on a sandbox by id, without a request."""
        return AsyncSandbox(self, sandbox_id)

    async def list(
        self, *, project: str | None = None, labels: dict[str, str] | None = None
    ) -> list[SandboxInfo]:
        return await self._call(_calls.list_sandboxes(project, labels))

    async def stop_many(self, ids: builtins.list[str]) -> None:
        """Stop sandboxes by id; ids that are already gone are ignored."""
        for start in range(0, len(ids), _calls.STOP_BATCH_MAX):
            _calls.stop_batch_raise(
                await self._call(_calls.stop_batch(ids[start : start + _calls.STOP_BATCH_MAX]))
            )

    # ------------------------------------------------------------------ cluster

    async def images(self) -> builtins.list[dict[str, Any]]:
        return await self._call(_calls.images())

    async def backends(self) -> builtins.list[BackendInfo]:
        """The isolation tiers (`create(backend=...)`): capabilities, and whether emulated."""
        return await self._call(_calls.backends())

    async def edges(self) -> builtins.list[EdgeStatus]:
        return await self._call(_calls.edges())

    async def health(self) -> dict[str, Any]:
        return await self._call(_calls.health())

    async def version(self) -> str:
        return await self._call(_calls.version())

    async def rotate_token(self, principal: str | None = None) -> str:
        """A new token for `principal` (a name or id; admins only) or, by default, for the
        caller. It is returned only here; the old one stops working at once, so a client that
        rotated its own token needs a new Client with the new one."""
        return await self._call(_calls.rotate_token(principal))

    async def revoke_token(self, principal: str | None = None) -> None:
        """Revoke `principal`'s token (admins only) or, by default, the caller's own (a leaked
        one): it stops working at once; an admin can issue a new one with rotate_token."""
        await self._call(_calls.revoke_token(principal))

    async def whoami(self) -> dict[str, Any]:
        """The principal this client's token belongs to: its id, name, admin flag, projects."""
        return await self._call(_calls.whoami())

    async def pause_project(self, project: str) -> builtins.list[str]:
        """Pause every sandbox of a project (a preempted job) in one call; their ids."""
        return await self._call(_calls.pause_project(project))

    async def snapshots(self) -> builtins.list[dict[str, Any]]:
        return await self._call(_calls.snapshots())

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._call(_calls.delete_snapshot(snapshot_id))

    async def checkpoints(self) -> builtins.list[Checkpoint]:
        return await self._call(_calls.checkpoints())

    async def restore(
        self, checkpoint_id: str, *, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> AsyncSandbox:
        """Restore a memory checkpoint: into a new sandbox with the checkpoint's files and spec
        (the default), or into the running sandbox `sandbox_id`, whose processes it replaces."""
        info = await self._call(_calls.restore(checkpoint_id, sandbox_id, labels))
        return AsyncSandbox(self, info.id, info)

    async def delete_checkpoint(self, checkpoint_id: str) -> None:
        await self._call(_calls.delete_checkpoint(checkpoint_id))

    async def announce_capacity(
        self, project: str, count: int, image: str = "python", **burst: Unpack[BurstOptions]
    ) -> Burst:
        """Announce a burst: ``count`` sandboxes of this shape will be created in ``project`` at
        ``when`` (seconds from now, or a time with its timezone). dsec pre-warms pools for them
        across the edges, adding edges through its node provider when they are short."""
        return await self._call(_calls.announce_capacity(project, count, image, burst))

    async def capacity(self) -> builtins.list[Burst]:
        """Announced bursts (of the caller's projects; admins: all) and what was done for each."""
        return await self._call(_calls.capacity())

    async def cancel_capacity(self, burst_id: str) -> Burst:
        """Cancel an announced burst: it no longer counts against its project's quota and its
        pre-warmed pool sandboxes are given back."""
        return await self._call(_calls.cancel_capacity(burst_id))

    async def image(self, name: str) -> dict[str, Any]:
        """One image: its digest (`name@digest` pins this content), layers, config, edges."""
        return await self._call(_calls.image(name))

    async def delete_image(self, name: str) -> None:
        """Delete an image (a project's by its members, a shared one by admins) and its pins;
        running sandboxes keep theirs."""
        await self._call(_calls.delete_image(name))

    async def build_image(
        self,
        context: str | Path,
        name: str,
        *,
        project: str | None = None,
        dockerfile: str = "Dockerfile",
        target: str | None = None,
        build_args: dict[str, str] | None = None,
        on_log: Callable[[str], None] | None = None,
    ) -> dict[str, Any]:
        """Build an image from a Dockerfile: `context` a local directory (uploaded; the server
        never reads the client's files), `dockerfile` its path in it, `name` the image's
        (``<project>/<name>`` in a project: its members' own; admins may leave `project` out).
        Each line of the build's log goes to `on_log` as it comes; the image is returned, or a
        failing step raises InvalidRequest (``details["reason"] == "build_failed"``, the
        step named, its output's tail)."""
        req = _calls.build_image(_base.tar_context(context), name, project, dockerfile, target, build_args)
        used, response = await self._send(req, stream=True)
        image = None
        try:
            async for line in response.aiter_lines():  # (each event as it comes)
                image = image or _base.build_events([line], on_log)
        except httpx.TransportError as exc:
            raise self._base._lost(exc, used) from exc
        finally:
            await response.aclose()
        if image is None:
            raise errors.Unavailable("the build's stream ended before its result", reason="stream_ended")
        return image

    async def pull_image(
        self, reference: str, *, name: str | None = None, project: str | None = None
    ) -> dict[str, Any]:
        """Pull an image by reference (``docker.io/library/python:3.12-slim``, ``ghcr.io/org/x:1``,
        ``registry.example.com:5000/team/env@sha256:...``) onto every edge, with `project`'s
        login to that registry (set_registry_login): the image is the project's own,
        ``<project>/<name>`` (`name`: default the reference's last part and tag). Admins may
        leave `project` out: an image every project sees. Returns the image (its digest,
        layers, config)."""
        return await self._call(_calls.pull_image(reference, name, project))

    async def set_registry_login(self, project: str, registry: str, username: str, password: str) -> None:
        """Keep `project`'s login to `registry` (``ghcr.io``, ``host:5000``) for its pulls; the
        password (or token) is never shown back."""
        await self._call(_calls.set_registry_login(project, registry, username, password))

    async def registry_logins(self, project: str) -> builtins.list[dict[str, Any]]:
        """`project`'s registry logins: registry and user name (no password)."""
        return await self._call(_calls.registry_logins(project))

    async def delete_registry_login(self, project: str, registry: str) -> None:
        await self._call(_calls.delete_registry_login(project, registry))

    async def drain_edge(self, name: str) -> dict[str, Any]:
        """Admins: edge ``name`` takes no new placements; its sandboxes keep working."""
        return await self._call(_calls.drain_edge(name))

    async def undrain_edge(self, name: str) -> dict[str, Any]:
        """Admins: edge ``name`` takes placements again."""
        return await self._call(_calls.undrain_edge(name))

    async def prewarm(self, count: int, image: str = "python", **spec: Unpack[SpecOptions]) -> dict[str, Any]:
        """Keep ``count`` sandboxes of this spec warm in a pool; returns the PoolInfo."""
        return await self._call(_calls.prewarm(count, _calls.build_spec(image, spec)))

    # ------------------------------------------------------------------ lifetime

    async def aclose(self) -> None:
        """Close the connections, once cancelled creates are undone (at most `UNDO_WAIT_S`)."""
        self._closing = True
        if self._undoing:
            await asyncio.wait(set(self._undoing), timeout=self.UNDO_WAIT_S)
            for task in list(self._undoing):
                task.cancel()
        for http, wire in self._conns:
            if wire is not None:
                await wire.aclose()
            await http.aclose()

    _end = aclose  # what leaving a `with` block does


class AsyncSandbox(_base.AsyncEndsOnExit):
    """A handle on one sandbox. ``async with await client.create() as sb:`` stops it on exit."""

    def __init__(self, client: AsyncClient, sandbox_id: str, info: SandboxInfo | None = None) -> None:
        self._client = client
        self.id = sandbox_id
        self.info = info
        self.files = AsyncFiles(client, sandbox_id)

    def __repr__(self) -> str:
        state = self.info.state.value if self.info else "?"
        return f"AsyncSandbox(id={self.id!r}, state={state!r})"

    async def exec(self, cmd: str | list[str], **opts: Unpack[_calls.ExecOptions]) -> ExecResult:
        """Run a command (a shell string or an argv list) to completion.

        With `step=(trajectory id, index)` the call is logged under that tag: sent again
        (after a preemption, a client restart, a retry) it returns the recorded result
        without running twice. Untagged calls are never retried. With `trusted=True` it runs
        with the image's own toolchain (read-only), the sandbox's files only in `task_dirs`
        (default /work and the workdir), as a platform uid, in a clean environment."""
        req = _calls.exec_request(cmd, opts, _calls.ExecOptions)
        return await self._client._call(_calls.exec_(self.id, req))

    def exec_stream(
        self, cmd: str | list[str], **opts: Unpack[_calls.StreamOptions]
    ) -> AsyncIterator[tuple[str, str | ExecResult]]:
        """Run a command, yielding ``("stdout"/"stderr", chunk)`` as it runs, then ``("result", ExecResult)``.

        Never retried. Closing the iterator early closes the HTTP stream.
        """
        req = _calls.exec_request(cmd, opts, _calls.StreamOptions)
        return self._stream(_calls.exec_stream(self.id, req))

    async def _stream(self, req: Request) -> AsyncIterator[tuple[str, str | ExecResult]]:
        client = self._client
        used, response = await client._send(req, stream=True)
        try:
            decoder = _stream.SSEDecoder()
            try:
                async for line in response.aiter_lines():
                    event = decoder.feed(line)
                    if event is not None and (item := _stream.exec_event(event)) is not None:
                        yield item
                        if item[0] == "result":
                            return
            except httpx.TransportError as exc:
                raise client._base._lost(exc, used) from exc
            event = decoder.flush()
            if event is not None and (item := _stream.exec_event(event)) is not None:
                yield item
                if item[0] == "result":
                    return
            client._base.failover(used)
            raise _stream.stream_ended_early()
        finally:
            await response.aclose()

    async def session(
        self, kind: str = "bash", *, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> AsyncSession:
        """Start a persistent shell (``bash``) or interpreter (``python``) in the sandbox."""
        info = await self._client._call(_calls.session_create(self.id, kind, env, cwd))
        return AsyncSession(self._client, self.id, info)

    async def sessions(self) -> list[SessionInfo]:
        return await self._client._call(_calls.session_list(self.id))

    async def pause(self) -> SandboxInfo:
        """Freeze the sandbox and give back its reclaimable memory; any later call resumes it."""
        self.info = await self._client._call(_calls.pause(self.id))
        return self.info

    async def resume(self) -> SandboxInfo:
        self.info = await self._client._call(_calls.resume(self.id))
        return self.info

    async def snapshot(self, scrub: list[str] | None = None) -> SnapshotInfo:
        """Pack the sandbox's files as an immutable snapshot (`scrub` paths left out);
        restore with `client.create(snapshot=info.id)`."""
        return await self._client._call(_calls.snapshot(self.id, list(scrub or [])))

    async def fork(self, n: int = 1) -> list[AsyncSandbox]:
        """`n` new sandboxes from this one's current files, each independent afterwards."""
        infos = await self._client._call(_calls.fork(self.id, n))
        return [AsyncSandbox(self._client, i.id, i) for i in infos]

    async def set_network(self, policy: NetworkPolicy | dict[str, Any] | None) -> dict[str, Any]:
        """Replace the egress allowlist while the sandbox runs (None: loopback only again);
        returns the policy and its counters."""
        p = policy if policy is None or isinstance(policy, NetworkPolicy) else _calls.validated_policy(policy)
        return await self._client._call(_calls.set_network(self.id, p))

    async def network(self) -> dict[str, Any]:
        """The egress policy and its counters (denied packets, DNS answers given and refused)."""
        return await self._client._call(_calls.network(self.id))

    async def protect(self, paths: list[str]) -> list[str]:
        """Move `paths` (graders, reference answers) out of the sandbox: its processes cannot
        read them any more; `verify()` runs one command with them back."""
        return await self._client._call(_calls.protect(self.id, list(paths)))

    async def verify(self, cmd: str | list[str], **opts: Unpack[_calls.VerifyOptions]) -> ExecResult:
        """The platform's verification step: every process of the sandbox is killed, then
        `cmd` runs trusted (the image's own toolchain, the sandbox's files only in `task_dirs`,
        the protected paths read-only, as the platform's uid; `user` is refused)."""
        req = _calls.exec_request(cmd, opts, _calls.VerifyOptions, timeout=300)
        return await self._client._call(_calls.verify(self.id, req))

    async def checkpoint(self, *, leave_running: bool = True) -> Checkpoint:
        """Checkpoint the sandbox's processes (memory, CRIU) with a copy of its files; restore
        with `client.restore(checkpoint.id)` (a new sandbox) or `restore(id, sandbox_id=...)`.
        Only processes running on their own qualify (start them with `nohup CMD > FILE 2>&1 &`);
        anything else raises UnsupportedOperation with `details["reason"]`."""
        return await self._client._call(_calls.checkpoint(self.id, leave_running))

    async def trajectory(self, *, after_seq: int = 0, limit: int | None = None) -> Trajectory:
        """The sandbox's logged operations in order (`.entries`, each an `Entry`) and counts
        (`.stats`: acknowledged, recorded, lost, pending); `t["entries"]` reads as before."""
        return await self._client._call(_calls.trajectory(self.id, after_seq, limit))

    async def trajectory_export(self, format: str = "jsonl") -> bytes:
        """The trajectory as JSON Lines or Parquet bytes."""
        return await self._client._call(_calls.trajectory_export(self.id, format))

    async def replay(self, trajectory: Trajectory) -> dict[str, Any]:
        """Run another sandbox's logged execs and edits here, in order, with their step tags
        (to rebuild a sandbox whose edge was lost from its shipped log). Stops at the first
        that fails. Returns {"replayed": n, "skipped": [(seq, why), ...]}."""
        steps, skipped = _calls.replay_plan(trajectory)
        for s in steps:
            if s.op == "exec":
                r = await self.exec(**s.args)
                if r.exit_code != 0:
                    raise errors.InvalidRequest(
                        f"replaying seq {s.seq} ({s.args['cmd']!r}) exited {r.exit_code}: {r.stderr[-500:]}"
                    )
            else:
                await self.files.edit(**s.args)
        return {"replayed": len(steps), "skipped": skipped}

    async def refresh(self) -> SandboxInfo:
        self.info = await self._client._call(_calls.get(self.id))
        return self.info

    async def stop(self) -> None:
        """Stop and remove the sandbox. Idempotent: stopping a gone sandbox is not an error."""
        with contextlib.suppress(errors.SandboxNotFound):
            await self._client._call(_calls.stop(self.id))

    _end = stop  # what leaving a `with` block does


class AsyncSession(_base.AsyncEndsOnExit):
    """A persistent bash or Python process inside a sandbox; state survives between runs."""

    def __init__(self, client: AsyncClient, sandbox_id: str, info: SessionInfo) -> None:
        self._client = client
        self.sandbox_id = sandbox_id
        self.id = info.id
        self.kind = info.kind.value
        self.info = info

    def __repr__(self) -> str:
        return f"AsyncSession(id={self.id!r}, kind={self.kind!r}, sandbox_id={self.sandbox_id!r})"

    async def run(
        self, code: str, *, timeout: float = 60, max_output_bytes: int = 1 << 20, step: StepArg = None
    ) -> SessionResult:
        """Run a command line (bash) or source (python) in the session (`step`: see exec)."""
        return await self._client._call(
            _calls.session_run(self.sandbox_id, self.id, code, timeout, max_output_bytes, step)
        )

    async def close(self) -> None:
        """End the session. Idempotent: closing a gone session is not an error."""
        with contextlib.suppress(errors.SessionNotFound):
            await self._client._call(_calls.session_close(self.sandbox_id, self.id))

    _end = close  # what leaving a `with` block does


class AsyncFiles:
    """The files of a sandbox: ``sandbox.files``. Paths are absolute paths inside the sandbox."""

    def __init__(self, client: AsyncClient, sandbox_id: str) -> None:
        self._client = client
        self.sandbox_id = sandbox_id

    async def _call(self, call: Call[T]) -> T:
        return await self._client._call(call)

    async def read(self, path: str) -> str:
        """A text file's content; raises ``errors.InvalidRequest`` if it is binary (use ``read_bytes``)."""
        return _calls.content_text(await self._call(_calls.file_read(self.sandbox_id, path)))

    async def read_bytes(self, path: str) -> bytes:
        return _calls.content_bytes(await self._call(_calls.file_read(self.sandbox_id, path)))

    async def write(
        self, path: str, content: str | bytes, *, mode: int = 0o644, step: StepArg = None
    ) -> None:
        """Write a file (``str`` as utf-8, ``bytes`` as they are), creating parent directories."""
        await self._call(_calls.file_write(self.sandbox_id, path, content, mode, step))

    async def edit(self, path: str, old: str, new: str, *, step: StepArg = None) -> int:
        """Replace ``old`` (which must occur exactly once) by ``new``; returns the new size."""
        return await self._call(_calls.file_edit(self.sandbox_id, path, old, new, step))

    async def list(self, path: str) -> list[FileStat]:
        return await self._call(_calls.file_list(self.sandbox_id, path))

    async def stat(self, path: str) -> FileStat:
        return await self._call(_calls.file_stat(self.sandbox_id, path))

    async def delete(self, path: str, *, recursive: bool = False) -> None:
        await self._call(_calls.file_delete(self.sandbox_id, path, recursive))

    async def upload(self, local_path: str | Path, remote_dir: str) -> None:
        """Copy a local file or directory into ``remote_dir`` (as ``remote_dir/<basename>``)."""
        await self.upload_tar(await asyncio.to_thread(_base.tar_local, local_path), remote_dir)

    async def upload_tar(self, data: bytes, remote_dir: str) -> None:
        await self._call(_calls.archive_put(self.sandbox_id, remote_dir, data))

    async def download(self, remote_path: str, local_dir: str | Path) -> None:
        """Copy a file or directory of the sandbox into ``local_dir`` (extracted by dsec.client._extract:
        nothing written outside ``local_dir`` or through a link, whatever the archive holds)."""
        data = await self.download_tar(remote_path)
        await asyncio.to_thread(_base.untar_local, data, local_dir)

    async def download_tar(self, remote_path: str) -> bytes:
        return await self._call(_calls.archive_get(self.sandbox_id, remote_path))
