"""SWE-ReX remote runtime protocol, per sandbox under /swerex/<sandbox-id>.

`swerex.runtime.remote.RemoteRuntime(host="http://<apiserver>/swerex/<sandbox-id>",
auth_token=<dsec token>)` works unmodified against these endpoints:

    GET  /is_alive          -> {is_alive, message}
    POST /create_session    -> {output, session_type}        a dsec bash session
    POST /run_in_session    -> {output, exit_code, failure_reason, expect_string, session_type}
    POST /close_session     -> {session_type}
    POST /execute           -> {stdout, stderr, exit_code}    a dsec exec
    POST /read_file         -> {content}
    POST /write_file        -> {}
    POST /upload            -> {}     multipart: file, target_path, unzip ("true": a zip to extract)
    POST /close             -> {}     closes this sandbox's SWE-ReX sessions, never the sandbox

Authentication is the `X-API-Key` header carrying a dsec token (these paths are
outside the apiserver's bearer gate); every edge call is scoped to the caller's
visible projects, so another project's sandbox answers exactly like a missing one.

Errors follow the reference server: a runtime failure is HTTP 511 with
`{"swerexception": {message, class_path, traceback, extra_info}}`, and the class
path names a SWE-ReX exception (or a builtin, e.g. FileNotFoundError for a missing
file) so the real client re-raises the same class. Platform conditions that are not
runtime errors keep plain HTTP statuses with `{"detail": ...}` (401 bad key, 404
unknown/invisible sandbox, 503 edge unavailable), which the client turns into
`aiohttp.ClientResponseError` (or `is_alive=False` for /is_alive).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import posixpath
import shlex
import tarfile
import tempfile
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import IO, Annotated, Any, Literal, NoReturn

from fastapi import APIRouter, Depends, File, Form, HTTPException, Request, Response, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field

from dsec import errors
from dsec.aio import wait_for
from dsec.edgeapi import EdgeAPI
from dsec.iam import Principal
from dsec.models import (
    DEFAULT_WORKDIR,
    ExecRequest,
    ExecResult,
    FileWrite,
    SandboxState,
    SessionCreate,
    SessionResult,
    SessionRun,
)

# dsec's longest allowed timeout stands in for SWE-ReX's "None: no timeout".
NO_TIMEOUT = 86400.0
# Per-stream output cap of one execute / run_in_session (SWE-ReX has none).
MAX_OUTPUT = 16 * 1024 * 1024
# What SWE-ReX's bash session reports as the matched expect string for a normal prompt.
PS1 = "SHELLPS1PREFIX"
# How many X-Request-ID answers to remember for idempotent retries.
REPLAY_CACHE = 512
# How many (sandbox, visible projects) access checks to remember (a sandbox's project never changes).
ACCESS_CACHE = 4096
# Bounds of one `upload` with unzip=true: bytes unpacked, members, and the compression ratio
# of any member (a zip bomb is refused before it is inflated).
MAX_UNZIP_BYTES = 512 * 1024 * 1024
MAX_UNZIP_ENTRIES = 100_000
MAX_UNZIP_RATIO = 200

_EXC = "swerex.exceptions."


class RexError(Exception):
    """An error to send as a SWE-ReX exception (HTTP 511) with this class path."""

    def __init__(self, class_path: str, message: str, extra_info: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.class_path = class_path
        self.message = message
        self.extra_info = extra_info or {}


def _nonzero(command: object, exit_code: int | None, output: str, error_msg: str | None) -> NoReturn:
    """SWE-ReX's NonZeroExitCodeError, worded as SWE-ReX words it."""
    msg = f"Command {command!r} failed with exit code {exit_code}. {output}"
    raise RexError(_EXC + "NonZeroExitCodeError", f"{error_msg}: {msg}" if error_msg else msg)


# --- wire models (SWE-ReX 1.4.0 swerex.runtime.abstract) ---------------------------------


class CreateBashSessionRequest(BaseModel):
    startup_source: list[str] = []
    session: str = "default"
    session_type: Literal["bash"] = "bash"
    startup_timeout: float = 1.0


class BashAction(BaseModel):
    command: str
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: Literal["silent", "raise", "ignore"] = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: Literal["bash"] = "bash"


class BashInterruptAction(BaseModel):
    session: str = "default"
    timeout: float = 0.2
    n_retry: int = 3
    expect: list[str] = []
    action_type: Literal["bash_interrupt"] = "bash_interrupt"


Action = Annotated[BashAction | BashInterruptAction, Field(discriminator="action_type")]


class BashObservation(BaseModel):
    output: str = ""
    exit_code: int | None = None
    failure_reason: str = ""
    expect_string: str = ""
    session_type: Literal["bash"] = "bash"


class CloseBashSessionRequest(BaseModel):
    session: str = "default"
    session_type: Literal["bash"] = "bash"


class Command(BaseModel):
    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class CommandResponse(BaseModel):
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None


class ReadFileRequest(BaseModel):
    path: str
    encoding: str | None = None
    errors: str | None = None


class WriteFileRequest(BaseModel):
    content: str
    path: str


# --- per-router state -------------------------------------------------------------------


@dataclass
class _RexSession:
    dsec_id: str
    shell_pid: int | None
    # Set while a run_in_session is in flight (in this process): what an interrupt waits for.
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass
class _Ctx:
    sid: str
    edge: EdgeAPI
    projects: set[str] | None


class _State:
    """SWE-ReX session names -> dsec sessions, and recent answers for X-Request-ID replays.

    This lives in the apiserver process that created the router: with several
    apiserver replicas behind a load balancer, a client must stick to one of them
    for its sessions (the dsec sessions themselves live on the edge and would simply
    be unreachable by name from another replica)."""

    def __init__(self) -> None:
        self.sessions: dict[tuple[str, str], _RexSession] = {}
        self.replies: OrderedDict[tuple[str, ...], tuple[int, bytes, str | None]] = OrderedDict()
        self.allowed: OrderedDict[tuple[str, frozenset[str] | None], None] = OrderedDict()

    async def check_access(self, ctx: _Ctx) -> None:
        """Raise SandboxNotFound (as for a missing sandbox) unless the caller may use the
        sandbox. Every endpoint that looks at this router's state (session names) does this
        first, so a stranger learns nothing from it and cannot change it."""
        key = (ctx.sid, None if ctx.projects is None else frozenset(ctx.projects))
        if key in self.allowed:
            self.allowed.move_to_end(key)
            return
        await ctx.edge.get(ctx.sid, ctx.projects)
        self.allowed[key] = None
        while len(self.allowed) > ACCESS_CACHE:
            self.allowed.popitem(last=False)

    async def forget_if_gone(self, ctx: _Ctx) -> None:
        """After a SandboxNotFound: drop the sandbox's sessions only if it is gone for
        everyone (not merely invisible to this caller)."""
        try:
            await ctx.edge.get(ctx.sid, None)
        except errors.SandboxNotFound:
            self.forget_sandbox(ctx.sid)
        except errors.DsecError:
            pass

    def forget_sandbox(self, sid: str) -> None:
        for key in [k for k in self.sessions if k[0] == sid]:
            del self.sessions[key]
        for seen in [k for k in self.allowed if k[0] == sid]:
            del self.allowed[seen]

    def remember(self, key: tuple[str, ...], response: Response) -> None:
        self.replies[key] = (response.status_code, bytes(response.body), response.media_type)
        while len(self.replies) > REPLAY_CACHE:
            self.replies.popitem(last=False)


# --- error mapping ----------------------------------------------------------------------


def _rex_response(class_path: str, message: str, extra_info: dict[str, Any] | None = None) -> JSONResponse:
    body = {"message": message, "class_path": class_path, "traceback": "", "extra_info": extra_info or {}}
    return JSONResponse({"swerexception": body}, status_code=511)


def _error_response(exc: Exception) -> Response:
    if isinstance(exc, RexError):
        return _rex_response(exc.class_path, exc.message, exc.extra_info)
    if isinstance(exc, errors.AuthError) and not isinstance(exc, errors.Forbidden):
        return JSONResponse({"detail": f"Invalid API Key: {exc.message}"}, status_code=401)
    if isinstance(exc, errors.SandboxNotFound | errors.Unavailable | errors.CapacityExhausted):
        return JSONResponse({"detail": exc.message}, status_code=exc.status)
    if isinstance(exc, errors.PayloadTooLarge):
        return JSONResponse({"detail": exc.message}, status_code=413)
    if isinstance(exc, errors.DsecError):
        cls = {
            errors.FileNotFound: "builtins.FileNotFoundError",
            errors.FileExists_: "builtins.FileExistsError",
            errors.PathEscape: "builtins.PermissionError",
            errors.Forbidden: "builtins.PermissionError",
            errors.SessionNotFound: _EXC + "SessionDoesNotExistError",
            errors.ExecTimeout: _EXC + "CommandTimeoutError",
        }.get(type(exc))
        if cls is None:
            cls = (
                "builtins.ValueError" if isinstance(exc, errors.InvalidRequest) else _EXC + "SwerexException"
            )
        return _rex_response(cls, exc.message, {"dsec_code": exc.code})
    if isinstance(exc, UnicodeError):
        return _rex_response(f"builtins.{type(exc).__name__}", str(exc))
    # A bug of ours: report it like the reference server would, without our traceback.
    return _rex_response(f"{type(exc).__module__}.{type(exc).__name__}", str(exc))


def _make_route_class(state: _State, resolve: Callable[[Request], _Ctx]) -> type[APIRoute]:
    class SwerexRoute(APIRoute):
        """Authenticates first, replays X-Request-ID retries, and turns every failure
        into the answer a SWE-ReX server would give."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def run(request: Request) -> Response:
                try:
                    ctx = resolve(request)
                except Exception as e:
                    return _error_response(e)
                request.state.swerex_ctx = ctx
                rid = request.headers.get("x-request-id")
                p: Principal = request.state.swerex_principal
                key = (p.id, ctx.sid, request.url.path, rid) if rid else None
                if key is not None and key in state.replies:
                    status, body, media = state.replies[key]
                    return Response(body, status_code=status, media_type=media)
                try:
                    response = await handler(request)
                except (HTTPException, RequestValidationError):
                    raise
                except Exception as e:
                    if isinstance(e, errors.SandboxNotFound):
                        await state.forget_if_gone(ctx)
                    response = _error_response(e)
                if key is not None and response.status_code in (200, 511):
                    state.remember(key, response)
                return response

            return run

    return SwerexRoute


# --- helpers ----------------------------------------------------------------------------


async def _absolute(ctx: _Ctx, path: str) -> str:
    """SWE-ReX resolves relative paths against its server's working directory; ours is
    the sandbox's workdir."""
    if path.startswith("/"):
        return path
    info = await ctx.edge.get(ctx.sid, ctx.projects)
    return posixpath.join(info.spec.workdir or DEFAULT_WORKDIR, path)


def _argv(cmd: Command) -> list[str]:
    """The argv subprocess.run(command, shell=...) would execute, with SWE-ReX's
    merge_output_streams (stderr=STDOUT: one pipe, order kept) as `exec 2>&1`."""
    if cmd.shell:
        argv = (
            ["/bin/sh", "-c", cmd.command]
            if isinstance(cmd.command, str)
            else ["/bin/sh", "-c", *cmd.command]
        )
    else:
        argv = [cmd.command] if isinstance(cmd.command, str) else list(cmd.command)
    if not argv or not argv[0]:
        raise RexError("builtins.ValueError", "command must not be empty")
    if cmd.merge_output_streams:
        argv = ["/bin/sh", "-c", 'exec 2>&1; exec "$@"', "sh", *argv]
    return argv


def _universal_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _tar_add(tf: tarfile.TarFile, name: str, data: bytes | None, mode: int, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = int(mtime)
    if data is None:
        info.type = tarfile.DIRTYPE
        info.mode = mode or 0o755
        tf.addfile(info)
    else:
        info.size = len(data)
        info.mode = mode or 0o644
        tf.addfile(info, io.BytesIO(data))


def _zip_to_tar(src: IO[bytes]) -> bytes:
    """Repack an uploaded zip as a tar for the edge's sandboxed unpacking (run it off the
    event loop). Member names are sanitised like zipfile.extractall does; unix permission
    bits are kept (SWE-ReX loses them, which only ever costs executable bits). Members are
    streamed into a temporary file, never inflated in memory, within MAX_UNZIP_BYTES,
    MAX_UNZIP_ENTRIES and MAX_UNZIP_RATIO (checked on the declared sizes first, and on what
    actually comes out while copying)."""
    now = time.time()
    try:
        zf = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise RexError("zipfile.BadZipFile", f"not a readable zip file: {e}") from e
    with zf, tempfile.TemporaryFile(prefix="dsec-unzip-") as out:
        members = zf.infolist()
        if len(members) > MAX_UNZIP_ENTRIES:
            raise errors.PayloadTooLarge(f"the zip holds more than {MAX_UNZIP_ENTRIES} members; split it")
        total = 0
        for zi in members:
            total += zi.file_size
            if zi.file_size > 1 << 20 and zi.file_size > MAX_UNZIP_RATIO * max(zi.compress_size, 1):
                raise errors.PayloadTooLarge(
                    f"zip member {zi.filename!r} inflates {zi.file_size // max(zi.compress_size, 1)}-fold "
                    f"(more than {MAX_UNZIP_RATIO}); refusing a likely zip bomb"
                )
        if total > MAX_UNZIP_BYTES:
            raise errors.PayloadTooLarge(
                f"the zip unpacks to {total} bytes, more than {MAX_UNZIP_BYTES}; split the upload"
            )
        try:
            with tarfile.open(fileobj=out, mode="w") as tf:
                for zi in members:
                    parts = [p for p in zi.filename.replace("\\", "/").split("/") if p not in ("", ".", "..")]
                    if not parts:
                        continue
                    mode = (zi.external_attr >> 16) & 0o7777
                    info = tarfile.TarInfo("/".join(parts))
                    info.mtime = int(now)
                    if zi.is_dir():
                        info.type = tarfile.DIRTYPE
                        info.mode = mode or 0o755
                        tf.addfile(info)
                        continue
                    info.size = zi.file_size
                    info.mode = mode or 0o644
                    with zf.open(zi) as member:  # checks the CRC and the declared size as it reads
                        tf.addfile(info, member)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
            raise RexError("zipfile.BadZipFile", f"the zip is damaged or lies about its sizes: {e}") from e
        out.seek(0)
        return out.read()


# Signal the processes of the session's running shell's process group except the shell
# itself: the commands it is running. Every run of a dsec bash session is a shell of its own,
# leader of its process group, whose command line carries `dsec-session-<id>;`.
_SIGNAL_GROUP = r"""
sig=$1; n=0; shell=
for f in $(grep -lsF "dsec-session-$2;" /proc/[0-9]*/cmdline); do
  pid=${f#/proc/}; pid=${pid%/cmdline}
  read -r line < "/proc/$pid/stat" 2>/dev/null || continue
  set -- ${line##*) }
  [ "$3" = "$pid" ] && shell=$pid
done
[ -n "$shell" ] || { echo 0; exit 0; }
for f in /proc/[0-9]*/stat; do
  read -r line < "$f" 2>/dev/null || continue
  pid=${f#/proc/}; pid=${pid%/stat}
  rest=${line##*) }
  set -- $rest
  if [ "$3" = "$shell" ] && [ "$pid" != "$shell" ]; then kill -s "$sig" "$pid" 2>/dev/null && n=$((n+1)); fi
done
echo "$n"
"""


def _ctx_dep(request: Request) -> _Ctx:
    ctx: _Ctx = request.state.swerex_ctx  # resolved (authenticated) by SwerexRoute
    return ctx


# Module level: FastAPI resolves the (postponed) annotations in the module's namespace.
Ctx = Annotated[_Ctx, Depends(_ctx_dep)]


# --- the router -------------------------------------------------------------------------


def swerex_router() -> APIRouter:  # noqa: C901 - one closure per endpoint
    state = _State()

    def resolve(request: Request) -> _Ctx:
        st = request.app.state.dsec
        principal: Principal = st.iam.authenticate(request.headers.get("x-api-key"))
        request.state.swerex_principal = principal
        sid = request.path_params["sid"]
        scope = st.iam.visible_projects(principal)
        return _Ctx(sid, st.directory.edge_for(sid, scope), scope)

    router = APIRouter(prefix="/swerex/{sid}", route_class=_make_route_class(state, resolve))

    def session_of(ctx: _Ctx, name: str) -> _RexSession:
        # Callers have passed state.check_access(ctx): a stranger never gets this far.
        s = state.sessions.get((ctx.sid, name))
        if s is None:
            raise RexError(_EXC + "SessionDoesNotExistError", f"session {name!r} does not exist")
        return s

    async def run_code(ctx: _Ctx, name: str, s: _RexSession, code: str, timeout: float) -> SessionResult:
        req = SessionRun(code=code, timeout=timeout, max_output_bytes=MAX_OUTPUT)
        try:
            return await ctx.edge.session_run(ctx.sid, s.dsec_id, req, ctx.projects)
        except errors.SessionNotFound as e:  # the shell ended (e.g. `exit`)
            if state.sessions.get((ctx.sid, name)) is s:
                del state.sessions[(ctx.sid, name)]
            raise RexError(_EXC + "SessionDoesNotExistError", e.message) from e

    @router.get("/is_alive")
    async def is_alive(ctx: Ctx) -> dict[str, Any]:
        info = await ctx.edge.get(ctx.sid, ctx.projects)
        if info.state is SandboxState.RUNNING:
            return {"is_alive": True, "message": ""}
        return {"is_alive": False, "message": f"sandbox {ctx.sid} is {info.state.value}"}

    @router.post("/create_session")
    async def create_session(body: CreateBashSessionRequest, ctx: Ctx) -> dict[str, Any]:
        await state.check_access(ctx)
        key = (ctx.sid, body.session)
        if key in state.sessions:
            raise RexError(_EXC + "SessionExistsError", f"session {body.session} already exists")
        info = await ctx.edge.session_create(ctx.sid, SessionCreate(kind="bash"), ctx.projects)
        s = _RexSession(info.id, None)
        state.sessions[key] = s
        try:
            # SWE-ReX's shell is interactive (a pty): aliases expand. Ours is a pipe.
            r = await run_code(ctx, body.session, s, "shopt -s expand_aliases; echo $$", 10.0)
            s.shell_pid = int(r.output.strip()) if r.output.strip().isdigit() else None
            output = ""
            if body.startup_source:
                src = " ; ".join(f"source {shlex.quote(p)}" for p in body.startup_source)
                r = await run_code(ctx, body.session, s, src, max(body.startup_timeout, 0.001))
                if r.timed_out:
                    raise RexError(
                        _EXC + "CommandTimeoutError",
                        f"timeout after {body.startup_timeout} seconds while sourcing {body.startup_source}",
                    )
                output = r.output
        except BaseException:
            state.sessions.pop(key, None)
            with contextlib.suppress(errors.DsecError):
                await ctx.edge.session_close(ctx.sid, info.id, ctx.projects)
            raise
        return {"output": output, "session_type": "bash"}

    async def check_syntax(ctx: _Ctx, command: str) -> None:
        """SWE-ReX checks a command with `bash -n` before running it."""
        req = ExecRequest(cmd=["bash", "-n"], stdin=command + "\n", timeout=30, max_output_bytes=65536)
        r = await ctx.edge.exec(ctx.sid, req, ctx.projects)
        if r.exit_code != 0 and not r.timed_out and r.exit_code != 127:
            msg = (
                f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
                f"---- Stderr ----\n{r.stderr}\n---- Stdout ----\n{r.stdout}"
            )
            extra = {"bash_stdout": r.stdout, "bash_stderr": r.stderr}
            raise RexError(_EXC + "BashIncorrectSyntaxError", msg, extra)

    async def run_bash(ctx: _Ctx, action: BashAction) -> BashObservation:
        s = session_of(ctx, action.session)
        if action.is_interactive_command or action.is_interactive_quit:
            raise RexError(
                "builtins.NotImplementedError",
                "interactive commands are not supported: dsec sessions run each command with stdin "
                "from /dev/null and wait for it to finish",
            )
        await check_syntax(ctx, action.command)
        timeout = min(action.timeout, NO_TIMEOUT) if action.timeout is not None else NO_TIMEOUT
        s.idle.clear()
        try:
            r = await run_code(ctx, action.session, s, action.command, max(timeout, 0.001))
        finally:
            s.idle.set()
        if r.timed_out:
            # Unlike SWE-ReX, the command is already killed: the session is ready for the next one.
            msg = f"timeout after {action.timeout} seconds while running command {action.command!r}"
            raise RexError(_EXC + "CommandTimeoutError", msg)
        exit_code = None if action.check == "ignore" else r.exit_code
        if action.check == "raise" and exit_code != 0:
            _nonzero(action.command, exit_code, f"Here is the output:\n{r.output!r}", action.error_msg)
        return BashObservation(output=r.output, exit_code=exit_code, expect_string=PS1)

    async def signal_group(ctx: _Ctx, s: _RexSession, sig: str) -> None:
        req = ExecRequest(cmd=["/bin/sh", "-c", _SIGNAL_GROUP, "sh", sig, s.dsec_id], timeout=30)
        await ctx.edge.exec(ctx.sid, req, ctx.projects)

    async def interrupt(ctx: _Ctx, action: BashInterruptAction) -> BashObservation:
        """Ctrl-C for the command a concurrent run_in_session is waiting on (through this
        apiserver). dsec already kills a command at its timeout, so after a
        CommandTimeoutError there is nothing left to interrupt and this returns at once."""
        s = session_of(ctx, action.session)
        if s.idle.is_set():
            return BashObservation(output="", exit_code=0, expect_string=PS1)
        for sig in ["INT"] * max(action.n_retry, 1) + ["KILL"]:
            await signal_group(ctx, s, sig)
            try:
                await wait_for(s.idle.wait(), max(action.timeout, 0.05))
            except TimeoutError:
                continue
            return BashObservation(output="", exit_code=0, expect_string=PS1)
        raise RexError(_EXC + "SwerexException", "Failed to interrupt session")

    @router.post("/run_in_session")
    async def run_in_session(action: Action, ctx: Ctx) -> dict[str, Any]:
        await state.check_access(ctx)
        if isinstance(action, BashInterruptAction):
            return (await interrupt(ctx, action)).model_dump()
        return (await run_bash(ctx, action)).model_dump()

    @router.post("/close_session")
    async def close_session(body: CloseBashSessionRequest, ctx: Ctx) -> dict[str, Any]:
        await state.check_access(ctx)
        s = session_of(ctx, body.session)
        with contextlib.suppress(errors.SessionNotFound):
            await ctx.edge.session_close(ctx.sid, s.dsec_id, ctx.projects)
        if state.sessions.get((ctx.sid, body.session)) is s:
            del state.sessions[(ctx.sid, body.session)]
        return {"session_type": "bash"}

    @router.post("/execute")
    async def execute(cmd: Command, ctx: Ctx) -> dict[str, Any]:
        timeout = min(cmd.timeout, NO_TIMEOUT) if cmd.timeout is not None else NO_TIMEOUT
        # SWE-ReX's subprocess env= replaces the environment; we layer it over the
        # sandbox's (PATH, HOME and the spec's env stay), which is what callers mean.
        req = ExecRequest(
            cmd=_argv(cmd),
            env=cmd.env or {},
            cwd=cmd.cwd,
            timeout=max(timeout, 0.001),
            max_output_bytes=MAX_OUTPUT,
        )
        r: ExecResult = await ctx.edge.exec(ctx.sid, req, ctx.projects)
        if r.timed_out:
            raise RexError(
                _EXC + "CommandTimeoutError", f"Timeout ({cmd.timeout}s) exceeded while running command"
            )
        out = CommandResponse(
            stdout=r.stdout, stderr="" if cmd.merge_output_streams else r.stderr, exit_code=r.exit_code
        )
        if cmd.check and r.exit_code != 0:
            _nonzero(
                cmd.command, r.exit_code, f"Stdout:\n{out.stdout!r}\nStderr:\n{out.stderr!r}", cmd.error_msg
            )
        return out.model_dump()

    @router.post("/read_file")
    async def read_file(body: ReadFileRequest, ctx: Ctx) -> dict[str, Any]:
        fc = await ctx.edge.read_file(ctx.sid, await _absolute(ctx, body.path), ctx.projects)
        encoding, errs = body.encoding or "utf-8", body.errors or "strict"
        if fc.encoding == "utf-8" and encoding.lower().replace("_", "-") in ("utf-8", "utf8"):
            text = fc.content
        else:
            raw = base64.b64decode(fc.content) if fc.encoding == "base64" else fc.content.encode()
            text = raw.decode(encoding, errs)
        # Path.read_text opens in text mode: universal newlines.
        return {"content": _universal_newlines(text)}

    @router.post("/write_file")
    async def write_file(body: WriteFileRequest, ctx: Ctx) -> dict[str, Any]:
        path = await _absolute(ctx, body.path)
        await ctx.edge.write_file(ctx.sid, FileWrite(path=path, content=body.content), ctx.projects)
        return {}

    @router.post("/upload")
    async def upload(
        ctx: Ctx,
        file: Annotated[UploadFile, File()],
        target_path: Annotated[str, Form()],
        unzip: Annotated[bool, Form()] = False,
    ) -> dict[str, Any]:
        try:
            await state.check_access(ctx)
            target = posixpath.normpath(await _absolute(ctx, target_path))
            if unzip:
                # Inflating is blocking work on untrusted input: a worker thread, bounded, on disk.
                tar = await asyncio.to_thread(_zip_to_tar, file.file)
                await ctx.edge.upload_tar(ctx.sid, target, tar, ctx.projects)
                return {}
            data = await file.read()
        finally:
            await file.close()
        parent, name = posixpath.split(target)
        if not name:
            raise RexError("builtins.IsADirectoryError", f"target path {target_path!r} names no file")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            _tar_add(tf, name, data, 0o644, time.time())
        await ctx.edge.upload_tar(ctx.sid, parent or "/", buf.getvalue(), ctx.projects)
        return {}

    @router.post("/close")
    async def close(ctx: Ctx) -> dict[str, Any]:
        await state.check_access(ctx)
        # SWE-ReX's close ends the runtime's shells; the machine it runs on is the
        # deployment's business (RemoteDeployment.stop only calls this). So we close the
        # sandbox's SWE-ReX sessions and leave the sandbox itself running: its owner
        # stops it through the dsec API (or its idle TTL does).
        for key in [k for k in state.sessions if k[0] == ctx.sid]:
            s = state.sessions.pop(key)
            with contextlib.suppress(errors.SessionNotFound):
                await ctx.edge.session_close(ctx.sid, s.dsec_id, ctx.projects)
        return {}

    return router


__all__ = ["RexError", "swerex_router"]
