"""The synchronous SDK: :class:`Client`, :class:`Sandbox`, :class:`Session`, :class:`Files`."""

from __future__ import annotations

import builtins
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Unpack

import httpx

from dsec import errors
from dsec.client import _base, _calls, _stream
from dsec.client._base import Call, Request, T
from dsec.client._calls import BurstOptions, SpecOptions, StepArg
from dsec.client._wire import Wire, usable
from dsec.models import (
    BackendInfo,
    Burst,
    Checkpoint,
    EdgeStatus,
    ExecResult,
    FileStat,
    NetworkPolicy,
    SandboxInfo,
    SessionInfo,
    SessionResult,
    SnapshotInfo,
    Trajectory,
)


class Client(_base.EndsOnExit):
    """A connection to dsec. One pooled ``httpx.Client`` per instance; thread-safe.

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
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._base = _base.BaseClient(url, token, timeout=timeout, retries=retries)
        self._conns: builtins.list[tuple[httpx.Client, Wire | None]] = []
        for u in self._base.urls:
            kwargs = self._base._client_kwargs(u)
            # Plain calls take the socket fast path (_wire.py) unless a transport is given.
            wire = (
                Wire(u, kwargs["headers"], max_keepalive=_base.MAX_KEEPALIVE)
                if transport is None and usable(u)
                else None
            )
            self._conns.append((httpx.Client(transport=transport, **kwargs), wire))

    @property
    def _http(self) -> httpx.Client:
        return self._conns[self._base.current][0]

    @property
    def _wire(self) -> Wire | None:
        return self._conns[self._base.current][1]

    @property
    def url(self) -> str:
        return self._base.url

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    # ------------------------------------------------------------------ I/O

    def _send(self, req: Request, *, stream: bool = False) -> tuple[int, httpx.Response]:
        """Send `req` (see BaseClient._retry_delay for where and how often); the apiserver
        that answered and its success response (`stream`: opened, its body not read)."""
        request_id = self._base._request_id()
        attempt = 0
        while True:
            used = self._base.current
            try:
                response = self._exchange(used, req, request_id, stream)
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
            time.sleep(delay)
            attempt += 1

    def _exchange(self, used: int, req: Request, request_id: str, stream: bool) -> httpx.Response:
        http, wire = self._conns[used]
        if stream:
            response = http.send(self._base._build(http, req, request_id), stream=True)
            if not response.is_success:
                try:
                    response.read()
                finally:
                    response.close()
            return response
        if wire is not None:
            return wire.request(*self._base._wire_call(wire, req, request_id))
        return http.send(self._base._build(http, req, request_id))

    def _call(self, call: Call[T]) -> T:
        return self._base._parse(call, self._send(call.request)[1])

    # ------------------------------------------------------------------ sandboxes

    def create(
        self,
        image: str = "python",
        *,
        snapshot: SnapshotInfo | str | None = None,
        idempotency_key: str | None = None,
        **spec: Unpack[SpecOptions],
    ) -> Sandbox:
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
        `backend=` the backend that runs it (the isolation tier; the default is container)."""
        full = _calls.build_spec(_calls.snapshot_image(snapshot) or image, spec)
        info = self._call(_calls.create(full, idempotency_key))
        return Sandbox(self, info.id, info)

    def create_many(
        self, n: int, image: str = "python", *, concurrency: int = 64, **spec: Unpack[SpecOptions]
    ) -> list[Sandbox]:
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
        lock = threading.Lock()

        def run(index: int) -> None:
            if failures:  # a batch failed: launch no more
                return
            try:
                batch = self._call(_calls.create_batch(chunks[index], full))
            except Exception as exc:
                with lock:
                    failures.append(exc)
                return
            results[index] = batch.sandboxes
            if batch.errors:
                with lock:
                    failures.append(batch.errors[0])

        with ThreadPoolExecutor(max_workers=min(concurrency, len(chunks)), thread_name_prefix="dsec") as pool:
            for future in [pool.submit(run, i) for i in range(len(chunks))]:
                future.result()
        infos = [info for chunk in results for info in chunk]
        if failures:
            with contextlib.suppress(Exception):
                self.stop_many([info.id for info in infos])
            raise failures[0]
        return [Sandbox(self, info.id, info) for info in infos]

    def get(self, sandbox_id: str) -> Sandbox:
        """A handle on an existing sandbox; raises :class:`errors.SandboxNotFound` if there is none."""
        info = self._call(_calls.get(sandbox_id))
        return Sandbox(self, info.id, info)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """A handle on a sandbox by id, without a request."""
        return Sandbox(self, sandbox_id)

    def list(self, *, project: str | None = None, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return self._call(_calls.list_sandboxes(project, labels))

    def stop_many(self, ids: builtins.list[str]) -> None:
        """Stop sandboxes by id; ids that are already gone are ignored."""
        for start in range(0, len(ids), _calls.STOP_BATCH_MAX):
            _calls.stop_batch_raise(self._call(_calls.stop_batch(ids[start : start + _calls.STOP_BATCH_MAX])))

    # ------------------------------------------------------------------ cluster

    def images(self) -> builtins.list[dict[str, Any]]:
        return self._call(_calls.images())

    def backends(self) -> builtins.list[BackendInfo]:
        """The isolation tiers (`create(backend=...)`): capabilities, and whether emulated."""
        return self._call(_calls.backends())

    def edges(self) -> builtins.list[EdgeStatus]:
        return self._call(_calls.edges())

    def health(self) -> dict[str, Any]:
        return self._call(_calls.health())

    def version(self) -> str:
        return self._call(_calls.version())

    def rotate_token(self, principal: str | None = None) -> str:
        """A new token for `principal` (a name or id; admins only) or, by default, for the
        caller. It is returned only here; the old one stops working at once, so a client that
        rotated its own token needs a new Client with the new one."""
        return self._call(_calls.rotate_token(principal))

    def revoke_token(self, principal: str | None = None) -> None:
        """Revoke `principal`'s token (admins only) or, by default, the caller's own (a leaked
        one): it stops working at once; an admin can issue a new one with rotate_token."""
        self._call(_calls.revoke_token(principal))

    def whoami(self) -> dict[str, Any]:
        """The principal this client's token belongs to: its id, name, admin flag, projects."""
        return self._call(_calls.whoami())

    def pause_project(self, project: str) -> builtins.list[str]:
        """Pause every sandbox of a project (a preempted job) in one call; their ids."""
        return self._call(_calls.pause_project(project))

    def snapshots(self) -> builtins.list[dict[str, Any]]:
        return self._call(_calls.snapshots())

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._call(_calls.delete_snapshot(snapshot_id))

    def checkpoints(self) -> builtins.list[Checkpoint]:
        return self._call(_calls.checkpoints())

    def restore(
        self, checkpoint_id: str, *, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> Sandbox:
        """Restore a memory checkpoint: into a new sandbox with the checkpoint's files and spec
        (the default), or into the running sandbox `sandbox_id`, whose processes it replaces."""
        info = self._call(_calls.restore(checkpoint_id, sandbox_id, labels))
        return Sandbox(self, info.id, info)

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._call(_calls.delete_checkpoint(checkpoint_id))

    def announce_capacity(
        self, project: str, count: int, image: str = "python", **burst: Unpack[BurstOptions]
    ) -> Burst:
        """Announce a burst: ``count`` sandboxes of this shape will be created in ``project`` at
        ``when`` (seconds from now, or a time with its timezone). dsec pre-warms pools for them
        across the edges, adding edges through its node provider when they are short."""
        return self._call(_calls.announce_capacity(project, count, image, burst))

    def capacity(self) -> builtins.list[Burst]:
        """Announced bursts (of the caller's projects; admins: all) and what was done for each."""
        return self._call(_calls.capacity())

    def cancel_capacity(self, burst_id: str) -> Burst:
        """Cancel an announced burst: it no longer counts against its project's quota and its
        pre-warmed pool sandboxes are given back."""
        return self._call(_calls.cancel_capacity(burst_id))

    def image(self, name: str) -> dict[str, Any]:
        """One image: its digest (`name@digest` pins this content), layers, config, edges."""
        return self._call(_calls.image(name))

    def delete_image(self, name: str) -> None:
        """Delete an image (a project's by its members, a shared one by admins) and its pins;
        running sandboxes keep theirs."""
        self._call(_calls.delete_image(name))

    def build_image(
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
        used, response = self._send(req, stream=True)
        try:
            image = _base.build_events(response.iter_lines(), on_log)
        except httpx.TransportError as exc:
            raise self._base._lost(exc, used) from exc
        finally:
            response.close()
        if image is None:
            raise errors.Unavailable("the build's stream ended before its result", reason="stream_ended")
        return image

    def pull_image(
        self, reference: str, *, name: str | None = None, project: str | None = None
    ) -> dict[str, Any]:
        """Pull an image by reference (``docker.io/library/python:3.12-slim``, ``ghcr.io/org/x:1``,
        ``registry.example.com:5000/team/env@sha256:...``) onto every edge, with `project`'s
        login to that registry (set_registry_login): the image is the project's own,
        ``<project>/<name>`` (`name`: default the reference's last part and tag). Admins may
        leave `project` out: an image every project sees. Returns the image (its digest,
        layers, config)."""
        return self._call(_calls.pull_image(reference, name, project))

    def set_registry_login(self, project: str, registry: str, username: str, password: str) -> None:
        """Keep `project`'s login to `registry` (``ghcr.io``, ``host:5000``) for its pulls; the
        password (or token) is never shown back."""
        self._call(_calls.set_registry_login(project, registry, username, password))

    def registry_logins(self, project: str) -> builtins.list[dict[str, Any]]:
        """`project`'s registry logins: registry and user name (no password)."""
        return self._call(_calls.registry_logins(project))

    def delete_registry_login(self, project: str, registry: str) -> None:
        self._call(_calls.delete_registry_login(project, registry))

    def drain_edge(self, name: str) -> dict[str, Any]:
        """Admins: edge ``name`` takes no new placements; its sandboxes keep working."""
        return self._call(_calls.drain_edge(name))

    def undrain_edge(self, name: str) -> dict[str, Any]:
        """Admins: edge ``name`` takes placements again."""
        return self._call(_calls.undrain_edge(name))

    def prewarm(self, count: int, image: str = "python", **spec: Unpack[SpecOptions]) -> dict[str, Any]:
        """Keep ``count`` sandboxes of this spec warm in a pool; returns the PoolInfo."""
        return self._call(_calls.prewarm(count, _calls.build_spec(image, spec)))

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        for http, wire in self._conns:
            if wire is not None:
                wire.close()
            http.close()

    _end = close  # what leaving a `with` block does


class Sandbox(_base.EndsOnExit):
    """A handle on one sandbox. ``with client.create() as sb:`` stops it on exit."""

    def __init__(self, client: Client, sandbox_id: str, info: SandboxInfo | None = None) -> None:
        self._client = client
        self.id = sandbox_id
        self.info = info
        self.files = Files(client, sandbox_id)

    def __repr__(self) -> str:
        state = self.info.state.value if self.info else "?"
        return f"Sandbox(id={self.id!r}, state={state!r})"

    def exec(self, cmd: str | list[str], **opts: Unpack[_calls.ExecOptions]) -> ExecResult:
        """Run a command (a shell string or an argv list) to completion.

        With `step=(trajectory id, index)` the call is logged under that tag: sent again
        (after a preemption, a client restart, a retry) it returns the recorded result
        without running twice. Untagged calls are never retried. With `trusted=True` it runs
        with the image's own toolchain (read-only), the sandbox's files only in `task_dirs`
        (default /work and the workdir), as a platform uid, in a clean environment."""
        req = _calls.exec_request(cmd, opts, _calls.ExecOptions)
        return self._client._call(_calls.exec_(self.id, req))

    def exec_stream(
        self, cmd: str | list[str], **opts: Unpack[_calls.StreamOptions]
    ) -> Iterator[tuple[str, str | ExecResult]]:
        """Run a command, yielding ``("stdout"/"stderr", chunk)`` as it runs, then ``("result", ExecResult)``.

        Never retried. Closing the iterator early closes the HTTP stream.
        """
        req = _calls.exec_request(cmd, opts, _calls.StreamOptions)
        return self._stream(_calls.exec_stream(self.id, req))

    def _stream(self, req: Request) -> Iterator[tuple[str, str | ExecResult]]:
        client = self._client
        used, response = client._send(req, stream=True)
        try:
            decoder = _stream.SSEDecoder()
            try:
                for line in response.iter_lines():
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
            response.close()

    def session(
        self, kind: str = "bash", *, env: dict[str, str] | None = None, cwd: str | None = None
    ) -> Session:
        """Start a persistent shell (``bash``) or interpreter (``python``) in the sandbox."""
        info = self._client._call(_calls.session_create(self.id, kind, env, cwd))
        return Session(self._client, self.id, info)

    def sessions(self) -> list[SessionInfo]:
        return self._client._call(_calls.session_list(self.id))

    def pause(self) -> SandboxInfo:
        """Freeze the sandbox and give back its reclaimable memory; any later call resumes it."""
        self.info = self._client._call(_calls.pause(self.id))
        return self.info

    def resume(self) -> SandboxInfo:
        self.info = self._client._call(_calls.resume(self.id))
        return self.info

    def snapshot(self, scrub: list[str] | None = None) -> SnapshotInfo:
        """Pack the sandbox's files as an immutable snapshot (`scrub` paths left out);
        restore with `client.create(snapshot=info.id)`."""
        return self._client._call(_calls.snapshot(self.id, list(scrub or [])))

    def fork(self, n: int = 1) -> list[Sandbox]:
        """`n` new sandboxes from this one's current files, each independent afterwards."""
        infos = self._client._call(_calls.fork(self.id, n))
        return [Sandbox(self._client, i.id, i) for i in infos]

    def set_network(self, policy: NetworkPolicy | dict[str, Any] | None) -> dict[str, Any]:
        """Replace the egress allowlist while the sandbox runs (None: loopback only again);
        returns the policy and its counters."""
        p = policy if policy is None or isinstance(policy, NetworkPolicy) else _calls.validated_policy(policy)
        return self._client._call(_calls.set_network(self.id, p))

    def network(self) -> dict[str, Any]:
        """The egress policy and its counters (denied packets, DNS answers given and refused)."""
        return self._client._call(_calls.network(self.id))

    def protect(self, paths: list[str]) -> list[str]:
        """Move `paths` (graders, reference answers) out of the sandbox: its processes cannot
        read them any more; `verify()` runs one command with them back."""
        return self._client._call(_calls.protect(self.id, list(paths)))

    def verify(self, cmd: str | list[str], **opts: Unpack[_calls.VerifyOptions]) -> ExecResult:
        """The platform's verification step: every process of the sandbox is killed, then
        `cmd` runs trusted (the image's own toolchain, the sandbox's files only in `task_dirs`,
        the protected paths read-only, as the platform's uid; `user` is refused)."""
        req = _calls.exec_request(cmd, opts, _calls.VerifyOptions, timeout=300)
        return self._client._call(_calls.verify(self.id, req))

    def checkpoint(self, *, leave_running: bool = True) -> Checkpoint:
        """Checkpoint the sandbox's processes (memory, CRIU) with a copy of its files; restore
        with `client.restore(checkpoint.id)` (a new sandbox) or `restore(id, sandbox_id=...)`.
        Only processes running on their own qualify (start them with `nohup CMD > FILE 2>&1 &`);
        anything else raises UnsupportedOperation with `details["reason"]`."""
        return self._client._call(_calls.checkpoint(self.id, leave_running))

    def trajectory(self, *, after_seq: int = 0, limit: int | None = None) -> Trajectory:
        """The sandbox's logged operations in order (`.entries`, each an `Entry`) and counts
        (`.stats`: acknowledged, recorded, lost, pending); `t["entries"]` reads as before."""
        return self._client._call(_calls.trajectory(self.id, after_seq, limit))

    def trajectory_export(self, format: str = "jsonl") -> bytes:
        """The trajectory as JSON Lines or Parquet bytes."""
        return self._client._call(_calls.trajectory_export(self.id, format))

    def replay(self, trajectory: Trajectory) -> dict[str, Any]:
        """Run another sandbox's logged execs and edits here, in order, with their step tags
        (to rebuild a sandbox whose edge was lost from its shipped log). Stops at the first
        that fails. Returns {"replayed": n, "skipped": [(seq, why), ...]}."""
        steps, skipped = _calls.replay_plan(trajectory)
        for s in steps:
            if s.op == "exec":
                r = self.exec(**s.args)
                if r.exit_code != 0:
                    raise errors.InvalidRequest(
                        f"replaying seq {s.seq} ({s.args['cmd']!r}) exited {r.exit_code}: {r.stderr[-500:]}"
                    )
            else:
                self.files.edit(**s.args)
        return {"replayed": len(steps), "skipped": skipped}

    def refresh(self) -> SandboxInfo:
        self.info = self._client._call(_calls.get(self.id))
        return self.info

    def stop(self) -> None:
        """Stop and remove the sandbox. Idempotent: stopping a gone sandbox is not an error."""
        with contextlib.suppress(errors.SandboxNotFound):
            self._client._call(_calls.stop(self.id))

    _end = stop  # what leaving a `with` block does


class Session(_base.EndsOnExit):
    """A persistent bash or Python process inside a sandbox; state survives between runs."""

    def __init__(self, client: Client, sandbox_id: str, info: SessionInfo) -> None:
        self._client = client
        self.sandbox_id = sandbox_id
        self.id = info.id
        self.kind = info.kind.value
        self.info = info

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, kind={self.kind!r}, sandbox_id={self.sandbox_id!r})"

    def run(
        self, code: str, *, timeout: float = 60, max_output_bytes: int = 1 << 20, step: StepArg = None
    ) -> SessionResult:
        """Run a command line (bash) or source (python) in the session (`step`: see exec)."""
        return self._client._call(
            _calls.session_run(self.sandbox_id, self.id, code, timeout, max_output_bytes, step)
        )

    def close(self) -> None:
        """End the session. Idempotent: closing a gone session is not an error."""
        with contextlib.suppress(errors.SessionNotFound):
            self._client._call(_calls.session_close(self.sandbox_id, self.id))

    _end = close  # what leaving a `with` block does


class Files:
    """The files of a sandbox: ``sandbox.files``. Paths are absolute paths inside the sandbox."""

    def __init__(self, client: Client, sandbox_id: str) -> None:
        self._client = client
        self.sandbox_id = sandbox_id

    def _call(self, call: Call[T]) -> T:
        return self._client._call(call)

    def read(self, path: str) -> str:
        """A text file's content; raises ``errors.InvalidRequest`` if it is binary (use ``read_bytes``)."""
        return _calls.content_text(self._call(_calls.file_read(self.sandbox_id, path)))

    def read_bytes(self, path: str) -> bytes:
        return _calls.content_bytes(self._call(_calls.file_read(self.sandbox_id, path)))

    def write(self, path: str, content: str | bytes, *, mode: int = 0o644, step: StepArg = None) -> None:
        """Write a file (``str`` as utf-8, ``bytes`` as they are), creating parent directories."""
        self._call(_calls.file_write(self.sandbox_id, path, content, mode, step))

    def edit(self, path: str, old: str, new: str, *, step: StepArg = None) -> int:
        """Replace ``old`` (which must occur exactly once) by ``new``; returns the new size."""
        return self._call(_calls.file_edit(self.sandbox_id, path, old, new, step))

    def list(self, path: str) -> list[FileStat]:
        return self._call(_calls.file_list(self.sandbox_id, path))

    def stat(self, path: str) -> FileStat:
        return self._call(_calls.file_stat(self.sandbox_id, path))

    def delete(self, path: str, *, recursive: bool = False) -> None:
        self._call(_calls.file_delete(self.sandbox_id, path, recursive))

    def upload(self, local_path: str | Path, remote_dir: str) -> None:
        """Copy a local file or directory into ``remote_dir`` (as ``remote_dir/<basename>``)."""
        self.upload_tar(_base.tar_local(local_path), remote_dir)

    def upload_tar(self, data: bytes, remote_dir: str) -> None:
        self._call(_calls.archive_put(self.sandbox_id, remote_dir, data))

    def download(self, remote_path: str, local_dir: str | Path) -> None:
        """Copy a file or directory of the sandbox into ``local_dir`` (extracted by dsec.client._extract:
        nothing written outside ``local_dir`` or through a link, whatever the archive holds)."""
        _base.untar_local(self.download_tar(remote_path), local_dir)

    def download_tar(self, remote_path: str) -> bytes:
        return self._call(_calls.archive_get(self.sandbox_id, remote_path))
