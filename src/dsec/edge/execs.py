"""Execs (plain, streamed, trusted), sessions, and the trajectory log of a sandbox's steps:
every operation an agent takes, recorded with its observation, replayed by step tag.

A collaborator of `Edge` (edge.py): what it needs of the rest of the edge is passed to its
constructor."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import logging
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dsec import errors
from dsec.backends.base import Capability
from dsec.backends.shim import Launch
from dsec.edge import trusted
from dsec.edge.core import EdgeCore, EdgePart
from dsec.edge.gradersandbox import GraderSandboxes
from dsec.edge.lifecycle import EdgeLifecycle
from dsec.edge.outputs import Flow, Observation, OutputBudget, observe
from dsec.edge.process import Capture, RawResult, run_process
from dsec.edge.sandbox import Sandbox
from dsec.edge.sessions import Runner, Session, open_session
from dsec.edge.telemetry import Telemetry
from dsec.http.output import HeldReply, StreamText, result_json
from dsec.isolation.spec import DEFAULT_PATH
from dsec.layers.userdb import resolve_user
from dsec.models import (
    ExecRequest,
    ExecResult,
    FileEdit,
    FileWrite,
    SessionCreate,
    SessionInfo,
    SessionResult,
    SessionRun,
    Step,
)
from dsec.native import ensure_trusted
from dsec.trajlog import StepTag, action_hash

log = logging.getLogger("dsec.edge")

Observed = TypeVar("Observed", dict[str, Any], Observation)


class EdgeExec(EdgePart):
    """exec, sessions and step logging (see the module)."""

    def __init__(self, core: EdgeCore, *, life: EdgeLifecycle, monitor: Telemetry, epoch: str) -> None:
        super().__init__(core)
        self.life = life  # sandboxes by id, their images and users
        self.monitor = monitor  # misbehaviour and denied connections after each exec
        self._epoch = epoch  # exec cgroup and session names carry it (see Edge.__init__)
        self._trusted_tool: Path | None = None  # dsec-trusted, built on the first trusted exec
        self._freeze = trusted.AgentFreeze(self.cgroups)  # the agent stopped while one runs
        # (trusted execs where no host process can join the sandbox: in fresh sandboxes)
        self.graders = GraderSandboxes(
            core, toolkit=lambda: life._toolkit, image=life._image, new_id=life._new_id, making=life._creating
        )
        self._inflight: dict[tuple[str, str, int], asyncio.Future[None]] = {}  # (project, trajectory, step)
        mib, conf = 1024 * 1024, self.settings
        self.budget = OutputBudget(conf.output_budget_mb * mib, conf.project_output_budget_mb * mib)
        self._streams: dict[str, int] = {}  # exec streams open, by project

    # --- exec ----------------------------------------------------------------------

    def _group_name(self, sb: Sandbox) -> str:
        return f"dsec-x{self._epoch}-{next(sb.counter)}"

    def _env(self, sb: Sandbox, extra: dict[str, str]) -> dict[str, str]:
        """The platform's defaults, under the image's ENV (its PATH too), under the sandbox
        spec's env, under the call's."""
        return {
            "PATH": DEFAULT_PATH,
            "HOME": sb.home,
            "LANG": "C.UTF-8",
            "HOSTNAME": sb.id,
            **sb.image_env,
            **sb.record.spec.env,
            **extra,
        }

    def _user(self, sb: Sandbox, user: str | None) -> tuple[int, int]:
        if user is None:
            return sb.uid, sb.gid
        uid, gid, _ = resolve_user(user, sb.users)
        return uid, gid

    def _run(
        self,
        sb: Sandbox,
        req: ExecRequest,
        *,
        stdin: bytes | None = None,
        cap: int | None = None,
        sink: Callable[[str, bytes], None] | None = None,
    ) -> Coroutine[Any, Any, RawResult]:
        """The one path every process started on request takes (exec, streams, archives)."""
        if req.trusted or req.task_dirs is not None:
            return self._run_trusted(sb, req, stdin=stdin, cap=cap, sink=sink)
        sb.backend.require(Capability.EXEC, "exec")
        argv = ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        uid, gid = self._user(sb, req.user)
        if stdin is None and req.stdin is not None:
            stdin = req.stdin.encode()
        return run_process(
            sb.handle,
            self.cgroups,
            self._group_name(sb),
            Launch(argv, self._env(sb, req.env), cwd=req.cwd or sb.workdir, uid=uid, gid=gid),
            stdin=stdin,
            timeout=req.timeout,
            cap=min(req.max_output_bytes, sb.record.spec.max_output_bytes) if cap is None else cap,
            sink=sink,
        )

    async def _run_trusted(
        self,
        sb: Sandbox,
        req: ExecRequest,
        *,
        protected: builtins.list[trusted.Protected] | None = None,
        stdin: bytes | None = None,
        cap: int | None = None,
        sink: Callable[[str, bytes], None] | None = None,
    ) -> RawResult:
        """Run `req` with the image's own toolchain (see dsec.edge.trusted)."""
        sb.backend.require(Capability.TRUSTED_EXEC, "trusted exec")
        dirs = self._trusted_checks(sb, req)
        if sb.backend.trusted_in_fresh_sandbox:  # (gVisor, a microVM: see dsec.edge.gradersandbox)
            return await self.graders.run(
                sb,
                dirs,
                protected or [],
                ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd),
                trusted.clean_env(req.env, sb.image_env, dirs),
                cwd=req.cwd or "/",
                group_name=self._group_name(sb),
                stdin=req.stdin.encode() if stdin is None and req.stdin is not None else stdin,
                timeout=req.timeout,
                cap=min(req.max_output_bytes, sb.record.spec.max_output_bytes) if cap is None else cap,
                sink=sink,
            )
        if self._trusted_tool is None:
            tool = await asyncio.get_running_loop().run_in_executor(
                None, ensure_trusted, self.settings.native_bin_dir
            )
            self.settings.edge_run_dir.joinpath("trusted").mkdir(mode=0o700, exist_ok=True)
            self._trusted_tool = tool
        bpf = sb.handle.seccomp_program()
        if bpf is None:
            raise errors.InternalError(f"sandbox {sb.id} has no compiled seccomp program for a trusted exec")
        spec = trusted.TrustedSpec(
            tool=self._trusted_tool,
            lowers=trusted.trusted_lowers(self.layers, self.life._image(sb.record.spec.image)),
            task_dirs=dirs,
            protected=protected or [],
            scratch=self.settings.edge_run_dir / "trusted",
            seccomp=bpf,
            uid_offset=self.settings.uid_offset,
            id_base=sb.handle.id_base,
            tmp_mb=sb.record.spec.disk_mb,
            cpu=sb.record.spec.cpu,
            memory_bytes=sb.record.spec.memory_mb << 20,
            pids=sb.record.spec.pids,
        )
        if stdin is None and req.stdin is not None:
            stdin = req.stdin.encode()
        async with self._freeze.hold(sb.id):  # the agent sees nothing of it, and cannot starve it
            return await trusted.run_trusted(
                spec,
                sb.handle,
                self.cgroups,
                self._group_name(sb),
                sb.root_fd,
                ["/bin/sh", "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd),
                trusted.clean_env(req.env, sb.image_env, dirs),
                # Not the workdir: `python3 -m X`, pytest's rootdir/conftest discovery and the like
                # load modules from their cwd, which would be the agent's files. A caller who
                # names a cwd in a task dir takes that on knowingly.
                cwd=req.cwd or "/",
                stdin=stdin,
                timeout=req.timeout,
                cap=min(req.max_output_bytes, sb.record.spec.max_output_bytes) if cap is None else cap,
                sink=sink,
            )

    @staticmethod
    def _trusted_checks(sb: Sandbox, req: ExecRequest) -> builtins.list[str]:
        """400s for what a trusted exec cannot do; its task directories."""
        if not req.trusted:
            raise errors.InvalidRequest("task_dirs applies to trusted execs only: pass trusted=true")
        if req.user is not None:
            raise errors.InvalidRequest(
                f"a trusted exec runs as the platform's own uid {trusted.TRUSTED_UID}, never as a "
                "sandbox user: drop `user`"
            )
        return trusted.task_dirs(req.task_dirs, sb.workdir)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await (await self.exec_reply(sandbox_id, req)).result()

    async def exec_reply(self, sandbox_id: str, req: ExecRequest) -> HeldReply:
        """An exec's answer as its JSON in pieces (see dsec.edge.outputs): the output is held
        once, under the project's budget, until the answer has been written."""
        sb = self.life._get(sandbox_id)
        action = {"op": "exec", **req.model_dump(include={"cmd", "stdin", "env", "cwd", "user"})}
        if req.trusted:  # another action than the same command untrusted (a replay must not mix them)
            action.update(trusted=True, task_dirs=req.task_dirs)
        hold = self.budget.hold(sb.record.spec.project)

        async def run() -> Observation:
            denied_before = sb.stats["denied_syscalls"]
            raw = await self._run(sb, req, sink=Capture(hold))
            meta = raw.meta()
            meta.misbehaviour = self.monitor.misbehaviour(sb, raw, denied_before)
            if (raw.exit_code != 0 or raw.timed_out) and sb.record.spec.network is not None:
                refused = await self.monitor.denied_connections(sb)
                if refused:
                    meta.misbehaviour["denied_connections"] = refused
            stdout, stderr, raw.stdout, raw.stderr = raw.stdout, raw.stderr, b"", b""
            return await observe(meta, stdout, stderr, hold)

        try:
            obs, seq, replayed = await self._logged(sb, "exec", action, req.step, run)
        except BaseException:
            hold.close()
            raise
        if isinstance(obs, Observation):
            return obs.reply(hold, seq)
        result = ExecResult.model_validate({**obs, "seq": seq, "replayed": replayed})
        body = result.model_dump_json().encode()
        hold.take(len(body))
        return HeldReply(result.model_copy(update={"stdout": "", "stderr": ""}), [body], hold.close)

    async def exec_stream(
        self, sandbox_id: str, req: ExecRequest
    ) -> AsyncIterator[tuple[str, bytes | ExecResult]]:
        """Like exec, yielding ("stdout" | "stderr", chunk) as output arrives, then ("result", ExecResult)."""
        async with contextlib.aclosing(self._stream(sandbox_id, req)) as events:
            async for kind, item in events:
                if kind == "result":
                    yield kind, item.to_exec_result()
                elif kind != "open":
                    yield kind, item

    async def exec_events(self, sandbox_id: str, req: ExecRequest) -> AsyncGenerator[bytes, None]:
        """The stream as server-sent events (docs/API.md), output made JSON text as it is
        written; an empty piece first, once the stream is admitted."""
        text = StreamText()
        async with contextlib.aclosing(self._stream(sandbox_id, req)) as events:
            async for kind, item in events:
                if kind == "open":
                    yield b""
                elif kind == "result":
                    yield text.flush() + b"event: result\ndata: "
                    async for piece in result_json(item.meta(), item.stdout, item.stderr):
                        yield piece
                    yield b"\n\n"
                else:
                    yield text.event(kind, item)

    async def _stream(self, sandbox_id: str, req: ExecRequest) -> AsyncGenerator[tuple[str, Any], None]:
        """("open", None) once admitted, ("stdout" | "stderr", bytes) as output is read, then
        ("result", RawResult). What is read and not yet taken is bounded (`Flow`): a slow
        reader leaves the pipes unread, and the command blocks writing."""
        sb = self.life._get(sandbox_id)
        project = sb.record.spec.project
        now = self._streams.get(project, 0)
        if now >= self.settings.project_streams:
            raise errors.QuotaExceeded(
                f"project {project!r} has {now} exec streams open on this edge, the most it may; "
                "read one to its end or close it first",
                reason="open_streams",
                limit=self.settings.project_streams,
            )
        self._streams[project] = now + 1
        hold, flow = self.budget.hold(project), Flow()
        task: asyncio.Task[RawResult] | None = None
        try:
            with self._active(sb):
                task = asyncio.create_task(self._run(sb, req, sink=Capture(hold, flow.put, flow)))
                task.add_done_callback(_ended(flow))
                yield "open", None
                while True:
                    kind, item = await flow.get()
                    if kind == "end":
                        yield "result", task.result()  # (or its failure, raised)
                        return
                    yield kind, item
        finally:
            if task is not None and not task.done():
                task.cancel()
            hold.close()
            self._streams[project] -= 1
            if not self._streams[project]:
                del self._streams[project]

    # --- sessions ------------------------------------------------------------------

    async def session_create(self, sandbox_id: str, req: SessionCreate) -> SessionInfo:
        sb = self.life._get(sandbox_id)
        sb.backend.require(Capability.SESSIONS, "sessions")
        if len(sb.sessions) >= 64:
            raise errors.QuotaExceeded("a sandbox holds at most 64 sessions; close one first")
        uid, gid = self._user(sb, req.user)
        sid = f"s{self._epoch}{next(sb.counter)}"
        session = await open_session(
            sid,
            req.kind,
            Runner(sb.handle, self.cgroups, uid, gid),
            self._env(sb, req.env),
            req.cwd or sb.workdir,
        )
        if len(sb.sessions) >= 64 or self.sandboxes.get(sb.id) is not sb:  # changed meanwhile
            session.close()
            self.life._get(sandbox_id)  # gone: not found
            raise errors.QuotaExceeded("a sandbox holds at most 64 sessions; close one first")
        sb.sessions[sid] = session
        return SessionInfo(id=sid, kind=req.kind, created_at=session.created_at)

    def _session(self, sb: Sandbox, session_id: str) -> Session:
        s = sb.sessions.get(session_id)
        if s is None:
            raise errors.SessionNotFound(
                f"session {session_id} does not exist in sandbox {sb.id}; create one first"
            )
        return s

    async def session_run(self, sandbox_id: str, session_id: str, req: SessionRun) -> SessionResult:
        sb = self.life._get(sandbox_id)
        s = self._session(sb, session_id)
        # The session id is left out of the action: after a client restart the same step
        # may come through a new session of the same kind.
        action = {"op": "session", "kind": s.kind.value, "code": req.code}

        async def run() -> dict[str, Any]:
            try:
                cap = min(req.max_output_bytes, sb.record.spec.max_output_bytes)
                return (await s.run(req.code, req.timeout, cap)).model_dump()
            except errors.SessionNotFound:
                sb.sessions.pop(session_id, None)
                s.close()
                raise

        obs, seq, replayed = await self._logged(sb, "session", action, req.step, run)
        return SessionResult.model_validate({**obs, "seq": seq, "replayed": replayed})

    # --- the trajectory log ------------------------------------------------------------

    async def _logged(
        self,
        sb: Sandbox,
        kind: str,
        action: dict[str, Any],
        step: Step | None,
        run: Callable[[], Awaitable[Observed]],
    ) -> tuple[Observed | dict[str, Any], int | None, bool]:
        """Run an operation once and log it; a tagged step already logged is replayed.

        Returns (observation, seq, replayed). The same tag arriving twice at once runs once:
        the second caller waits for the first.

        Step tags are scoped to the sandbox's project: a tag is found, replayed and refused
        only among what that project logged (a replay in a new sandbox of the same project
        works; another tenant's identical tag is another step, and a divergence shows only
        the caller's own project's action).
        """
        tag = StepTag(step.trajectory, step.index, sb.record.spec.project) if step else None
        key = (tag.scope, tag.trajectory, tag.index) if tag else None
        if tag is not None and key is not None:
            pending = self._inflight.get(key)
            if pending is not None:
                await asyncio.shield(pending)
            entry = self.trajlog.find_step(tag.trajectory, tag.index, tag.scope, sb.id)
            if entry is not None:
                if entry.action_hash != action_hash(action):
                    raise errors.TrajectoryDivergence(
                        f"step {tag.index} of trajectory {tag.trajectory!r} was logged with a different "
                        f"{entry.kind} action; resume from the logged steps or start a new trajectory id",
                        trajectory=tag.trajectory,
                        index=tag.index,
                        logged=entry.action,
                    )
                return dict(entry.observation or {}), entry.seq, True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if key is not None:
            self._inflight[key] = done
        try:
            t0 = time.perf_counter()
            with self._active(sb):
                obs = await run()
            timings = {"duration_ms": (time.perf_counter() - t0) * 1000}
            stored = obs.doc if isinstance(obs, Observation) else obs  # (an exec's: JSON already)
            seq = await self.trajlog.record(
                sb.id, kind, action, stored, timings, tag, durable=self.settings.trajectory_durable_acks
            )
            return obs, seq, False
        finally:
            if key is not None:
                self._inflight.pop(key, None)
            done.set_result(None)

    @contextlib.contextmanager
    def _active(self, sb: Sandbox) -> Iterator[None]:
        """An operation in flight on `sb`: the idle reaper leaves it alone until it ends, and
        its end counts as activity (a long exec must not be reaped the moment it returns)."""
        sb.busy += 1
        try:
            yield
        finally:
            sb.busy -= 1
            now = time.time()
            sb.record.last_active = now
            self._dirty_active[sb.id] = now

    async def write_logged(self, sandbox_id: str, req: FileWrite, data: bytes) -> None:
        sb = self.life._get(sandbox_id)
        sb.backend.require(Capability.FILES, "file operations")
        digest = hashlib.sha256(data).hexdigest()
        action = {"op": "write", "path": req.path, "sha256": digest, "size": len(data), "mode": req.mode}

        async def run() -> dict[str, Any]:
            await (sb.guest or sb.files).write_charged(req.path, data, req.mode)
            return {}

        await self._logged(sb, "file", action, req.step, run)

    async def edit_logged(self, sandbox_id: str, req: FileEdit) -> int:
        sb = self.life._get(sandbox_id)
        sb.backend.require(Capability.FILES, "file operations")
        action = {"op": "edit", "path": req.path, "old": req.old, "new": req.new}

        async def run() -> dict[str, Any]:
            return {"size": await (sb.guest or sb.files).edit(req.path, req.old, req.new)}

        obs, _, _ = await self._logged(sb, "file", action, req.step, run)
        return int(obs["size"])

    async def log_event(
        self, sandbox_id: str, kind: str, action: dict[str, Any], obs: dict[str, Any]
    ) -> None:
        """Log an operation that is not a step (delete, upload, snapshot, fork, pause...)."""
        await self.trajlog.record(
            sandbox_id, kind, action, obs, {}, durable=self.settings.trajectory_durable_acks
        )

    async def trajectory(
        self, sandbox_id: str, *, after_seq: int = 0, limit: int | None = None
    ) -> dict[str, Any]:
        """The logged operations in seq order (flushed first), gaps included, and the counts."""
        self.life._lookup(sandbox_id)
        await self.trajlog.flush()
        entries = self.trajlog.read(sandbox_id, after_seq=after_seq, limit=limit)
        return {
            "entries": [e.model_dump(mode="json") for e in entries],
            "stats": self.trajlog.stats(sandbox_id),
        }

    async def trajectory_export(self, sandbox_id: str, fmt: str) -> bytes:
        self.life._lookup(sandbox_id)
        if fmt not in ("jsonl", "parquet"):
            raise errors.InvalidRequest(f"unknown export format {fmt!r}: use jsonl or parquet")
        await self.trajlog.flush()
        with tempfile.TemporaryDirectory(prefix="dsec-export-") as tmp:
            path = Path(tmp) / f"trajectory.{fmt}"
            if fmt == "jsonl":
                self.trajlog.export_jsonl(sandbox_id, path)
            else:
                self.trajlog.export_parquet(sandbox_id, path)
            return path.read_bytes()

    def session_list(self, sandbox_id: str) -> builtins.list[SessionInfo]:
        sb = self.life._get(sandbox_id)
        return [SessionInfo(id=s.id, kind=s.kind, created_at=s.created_at) for s in sb.sessions.values()]

    async def session_close(self, sandbox_id: str, session_id: str) -> None:
        sb = self.life._get(sandbox_id)
        s = self._session(sb, session_id)
        sb.sessions.pop(session_id, None)
        await asyncio.get_running_loop().run_in_executor(None, s.close)


def _ended(flow: Flow) -> Callable[[asyncio.Task[RawResult]], None]:
    """A streamed command's end, told to its reader (its failure is taken, and raised there)."""

    def ended(task: asyncio.Task[RawResult]) -> None:
        if not task.cancelled():
            task.exception()  # (a stream its reader left is not an unretrieved failure)
        flow.put("end", None)

    return ended
