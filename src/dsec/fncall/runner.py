"""The fncall runner: a resident process inside a worker sandbox that runs one call at a time.

This file is shipped into the sandbox as the source of `python3 -c` (stdlib only;
it must run on the image's Python). Its fd 0 is one end of an AF_UNIX stream
socketpair whose other end the edge holds (the control channel); it speaks JSON
lines on it:

    request  {"id", "op": "run", "language", "code", "stdin", "files": {rel path: base64},
              "fetch_files": [rel path], "compile_timeout", "run_timeout",
              "memory_limit_mb", "max_output", "source", "compile": argv|None, "run": argv, "env"}
             (the language's plan, dsec/fncall/languages.py: this runner knows no language)
             {"id", "op": "jupyter", "cells": [str], "cell_timeout", "total_timeout", ...}
             with exactly one descriptor attached (SCM_RIGHTS): the cgroup.procs of the
             call's own cgroup, which the edge created for this call
    reply    {"id", "compile": Stage|None, "run": Stage|None, "files": {...}, "healthy": bool, ...}

Each call gets a fresh scratch directory and fresh processes: the runner forks; the
child first joins the call's cgroup (writes "0" to the descriptor), then closes every
descriptor but its own stdio (so no code of the call ever holds the control channel:
the channel is close-on-exec in the runner and closed in every child, and the runner
is not dumpable, so its /proc/<pid>/fd cannot be opened either), drops to an
unprivileged uid (it can write only its scratch directory: /tmp, /var/tmp and /dev/shm
are closed to it), sets rlimits and runs the code; Python code runs in the forked
child of this already-warm interpreter (no interpreter start). Exit statuses come
only from this runner's waitpid(). After the reply the edge kills the call's cgroup
as a whole (pids.max=0, then SIGKILL until empty) and removes it before the worker
serves anyone again.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import time
import traceback
from typing import Any

RUN_UID = 1000
SCRATCH_ROOT = "/fncall"
PRELOAD = (
    "math",
    "re",
    "collections",
    "itertools",
    "functools",
    "heapq",
    "bisect",
    "random",
    "string",
    "typing",
    "dataclasses",
    "fractions",
    "decimal",
    "statistics",
    "numpy",
)


def _preload() -> None:
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            __import__(name)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


_CHAN: socket.socket | None = None  # the control channel (close-on-exec; closed in every child)


def _nondumpable() -> None:
    """PR_SET_DUMPABLE 0: /proc/<runner>/fd, mem and environ belong to root and no process
    of a lower privilege may ptrace the runner. Also loads libc for _close_from()."""
    global _LIBC
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True)
    if _LIBC.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _enter_child(cgroup_fd: int, stdio: tuple[int, int, int], keep: int = -1) -> None:
    """The first thing every forked child does, before any code of the call runs: join the
    call's cgroup (so the edge can kill all of it), put its stdio in place and close every
    other descriptor (the control channel above all); `keep` (if any) ends up as fd 3."""
    try:
        os.write(cgroup_fd, b"0")
        for fd, target in zip(stdio, (0, 1, 2), strict=True):
            if fd != target:
                os.dup2(fd, target)
        if keep >= 0:
            os.dup2(keep, 3)
        _close_from(4 if keep >= 0 else 3)
        if _CHAN is not None:
            _CHAN.detach()  # that number is closed now: no finalizer may close a reused one
    except BaseException as e:
        with contextlib.suppress(Exception):
            os.write(2, f"fncall: cannot set the call up: {type(e).__name__}: {e}\n".encode())
        os._exit(126)


_LIBC: Any = None
SYS_CLOSE_RANGE = 436  # the same number on x86_64 and arm64


def _close_from(low: int) -> None:
    """Close every descriptor >= low: close_range(2), else one close() per possible fd."""
    if _LIBC is not None and _LIBC.syscall(SYS_CLOSE_RANGE, low, 0xFFFFFFFF, 0) == 0:
        return
    os.closerange(low, max(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 16))


def _drop_privileges(cwd: str, memory_mb: int, in_process: bool = False) -> None:
    os.setsid()
    os.setgroups([])
    os.setgid(RUN_UID)
    os.setuid(RUN_UID)
    os.chdir(cwd)
    resource.setrlimit(resource.RLIMIT_NPROC, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_mb > 0:
        # Code that runs in this forked interpreter inherits its address space
        # (preloaded modules): the limit is on top of it. An exec'd program starts
        # from nothing, so the limit is absolute there.
        limit = memory_mb * 1024 * 1024 + (_vm_size() if in_process else 0)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ.update(HOME=cwd, TMPDIR=cwd, USER="runner", LOGNAME="runner")


def _child_python(code: str) -> None:
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=False)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.argv = ["main.py"]
    sys.path[0] = os.getcwd()
    status = 0
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


def _child_pytest() -> None:
    import pytest  # imported per call: only pytest runs pay for it

    os._exit(int(pytest.main(["-q", "-p", "no:cacheprovider", "test_main.py"])))


def run_stage(
    argv: list[str],
    code: str,
    cwd: str,
    stdin: bytes,
    timeout: float,
    memory_mb: int,
    max_output: int,
    cgroup_fd: int,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Fork, run `argv` (or the in-process Python path), collect output; a Stage dict."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _enter_child(cgroup_fd, (in_r, out_w, err_w))
        try:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            _drop_privileges(cwd, memory_mb, in_process=argv[0] in ("PYTHON", "PYTEST"))
            os.environ.update(env or {})
            if argv == ["PYTHON"]:
                _child_python(code)
            elif argv == ["PYTEST"]:
                _child_pytest()
            os.execvp(argv[0], argv)
        except BaseException as e:
            with contextlib.suppress(Exception):
                os.write(2, f"{type(e).__name__}: {e}\n".encode())
        os._exit(127)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    out, err, truncated = _pump(pid, in_w, out_r, err_r, stdin, t0 + timeout, max_output)
    timed_out = False
    status = _reap(pid, t0 + timeout)
    if status is None:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # background children of the call
    elapsed = time.monotonic() - t0
    code_ = os.waitstatus_to_exitcode(status)
    return {
        "status": "TimeLimitExceeded" if timed_out else ("Finished" if code_ == 0 else "Error"),
        "execution_time": round(elapsed, 6),
        "return_code": None if timed_out else code_,
        "stdout": out.decode(errors="replace"),
        "stderr": err.decode(errors="replace"),
        "truncated": truncated,
    }


def _pump(
    pid: int, in_w: int, out_r: int, err_r: int, stdin: bytes, deadline: float, cap: int
) -> tuple[bytes, bytes, bool]:
    bufs = {out_r: bytearray(), err_r: bytearray()}
    truncated = False
    view = memoryview(stdin)
    if not view:
        os.close(in_w)
        in_w = -1
    open_r = [out_r, err_r]
    while open_r:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        wset = [in_w] if in_w >= 0 else []
        r, w, _ = select.select(open_r, wset, [], left)
        if w:
            try:
                n = os.write(in_w, view[:65536])
                view = view[n:]
            except BrokenPipeError:
                view = view[:0]
            if not view:
                os.close(in_w)
                in_w = -1
        for fd in r:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_r.remove(fd)
                continue
            buf = bufs[fd]
            room = cap - len(buf)
            if len(chunk) > room:
                truncated = True
            buf += chunk[: max(room, 0)]
        if truncated:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            break
    for fd in (in_w, out_r, err_r):
        if fd >= 0:
            os.close(fd)
    return bytes(bufs[out_r]), bytes(bufs[err_r]), truncated


def _reap(pid: int, deadline: float) -> int | None:
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.0005)


def _scratch(n: int) -> str:
    path = f"{SCRATCH_ROOT}/{os.getpid()}-{n}"
    os.mkdir(path, 0o700)
    os.chown(path, RUN_UID, RUN_UID)
    return path


def _write_files(cwd: str, files: dict[str, str | None]) -> None:
    for rel, content in files.items():
        if content is None:
            continue
        target = os.path.normpath(os.path.join(cwd, rel))
        if not target.startswith(cwd + "/"):
            raise ValueError(f"file path {rel!r} leaves the working directory")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(base64.b64decode(content))
    for dirpath, dirnames, filenames in os.walk(cwd):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), RUN_UID, RUN_UID)


def _read_files(cwd: str, names: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for rel in names:
        target = os.path.realpath(os.path.join(cwd, rel))
        if not target.startswith(cwd + "/") or not os.path.isfile(target):
            out[rel] = None
            continue
        with open(target, "rb") as f:
            out[rel] = base64.b64encode(f.read(16 * 1024 * 1024)).decode()
    return out


def _fetch_files(cwd: str, names: list[str], cgroup_fd: int) -> dict[str, str | None]:
    """The files the caller asked for, read as the call's uid in the call's cgroup: the
    call's processes may still live and swap a checked path for a symlink, which then
    reaches only what the code itself could read."""
    if not names:
        return {}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        nul = os.open(os.devnull, os.O_RDWR)
        _enter_child(cgroup_fd, (nul, nul, nul), keep=w)
        try:
            os.setgroups([])
            os.setgid(RUN_UID)
            os.setuid(RUN_UID)
            data = json.dumps(_read_files(cwd, names)).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(3, view) :]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        got = json.loads(b"".join(chunks))
    except ValueError:
        got = {}
    if not isinstance(got, dict):
        got = {}
    return {rel: got[rel] if isinstance(got.get(rel), str) else None for rel in names}


def _sweep() -> None:
    """What an earlier call may have left for this one (the edge has killed all its processes
    before this call came): scratch directories kept alive past its rmtree, and System V IPC
    objects (shared memory, semaphores, message queues), which outlive their processes."""
    for name in os.listdir(SCRATCH_ROOT):
        shutil.rmtree(f"{SCRATCH_ROOT}/{name}", ignore_errors=True)
    left = {kind: _ipc_ids(kind) for kind in ("shm", "msg", "sem")}
    if _LIBC is None or not any(left.values()):
        return
    # Only their owner may remove them (the runner lacks CAP_IPC_OWNER): a child as that uid.
    pid = os.fork()
    if pid == 0:
        try:
            _close_from(3)  # the control channel above all
            os.setgroups([])
            os.setgid(RUN_UID)
            os.setuid(RUN_UID)
            for ident in left["shm"]:
                _LIBC.shmctl(ident, 0, None)  # IPC_RMID
            for ident in left["msg"]:
                _LIBC.msgctl(ident, 0, None)
            for ident in left["sem"]:
                _LIBC.semctl(ident, 0, 0)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _ipc_ids(kind: str) -> list[int]:
    """The ids of the IPC objects of `kind` owned by the call's uid (from /proc/sysvipc)."""
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    if not lines:
        return []
    head = lines[0].split()
    col_id = head.index({"shm": "shmid", "msg": "msqid", "sem": "semid"}[kind])
    col_uid, col_cuid = head.index("uid"), head.index("cuid")
    out = []
    for line in lines[1:]:
        cols = line.split()
        with contextlib.suppress(ValueError, IndexError):
            if RUN_UID in (int(cols[col_uid]), int(cols[col_cuid])):
                out.append(int(cols[col_id]))
    return out


def _cleanup(cwd: str) -> None:
    # A second line only (the edge kills the call's cgroup as a whole): anything the call
    # left running as RUN_UID dies (the runner is root; the code cannot signal it), then
    # the scratch goes.
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}").st_uid == RUN_UID:
                    os.kill(int(entry), signal.SIGKILL)
    shutil.rmtree(cwd, ignore_errors=True)


def _healthy() -> bool:
    return all(os.path.exists(p) for p in ("/bin/sh", sys.executable, SCRATCH_ROOT)) and os.access(
        SCRATCH_ROOT, os.W_OK
    )


def _missing_tool(argvs: list[list[str] | None]) -> str | None:
    """The first program of the plan this image lacks (the in-process paths need none, and a
    path such as ./main is what the compile makes)."""
    for argv in argvs:
        if argv and argv[0] not in ("PYTHON", "PYTEST") and "/" not in argv[0] and not shutil.which(argv[0]):
            return argv[0]
    return None


def handle_run(req: dict[str, Any], n: int, cgroup_fd: int) -> dict[str, Any]:
    lang = req.get("language") or "python"
    compile_argv, run_argv = req.get("compile"), req["run"]
    missing = _missing_tool([compile_argv, run_argv])
    if missing is not None:
        return {
            "error": f"language {lang!r} needs {missing!r}, which this image does not have "
            "(the `code` image has every available language)",
            "error_kind": "unsupported_language",
        }
    cwd = _scratch(n)
    try:
        files = dict(req.get("files") or {})
        files[req["source"]] = base64.b64encode(req["code"].encode()).decode()
        _write_files(cwd, files)
        cap = int(req.get("max_output", 1 << 20))
        mem = int(req.get("memory_limit_mb", -1))
        env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
        compile_stage = None
        if compile_argv is not None:
            timeout = float(req.get("compile_timeout", 10))
            compile_stage = run_stage(compile_argv, "", cwd, b"", timeout, -1, cap, cgroup_fd, env)
            if compile_stage["status"] != "Finished" or compile_stage["return_code"] != 0:
                return {"compile": compile_stage, "run": None, "files": {}}
        stdin = (req.get("stdin") or "").encode()
        timeout = float(req.get("run_timeout", 10))
        run = run_stage(run_argv, req["code"], cwd, stdin, timeout, mem, cap, cgroup_fd, env)
        return {
            "compile": compile_stage,
            "run": run,
            "files": _fetch_files(cwd, list(req.get("fetch_files") or []), cgroup_fd),
        }
    finally:
        _cleanup(cwd)


def _jupyter_child(cells: list[str], cell_timeout: float, result_fd: int) -> None:
    ns: dict[str, Any] = {"__name__": "__main__"}
    results = []

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError("cell timed out")

    signal.signal(signal.SIGALRM, alarm)
    for cell in cells:
        out, err = io.StringIO(), io.StringIO()
        display: list[dict[str, str]] = []
        error: list[dict[str, Any]] = []
        if cell_timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, cell_timeout)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                import ast

                tree = ast.parse(cell, "<cell>")
                last = None
                if tree.body and isinstance(tree.body[-1], ast.Expr):
                    last = ast.Expression(tree.body[-1].value)
                    tree.body.pop()
                exec(compile(tree, "<cell>", "exec"), ns)
                if last is not None:
                    value = eval(compile(last, "<cell>", "eval"), ns)
                    if value is not None:
                        display.append({"text/plain": repr(value)})
        except BaseException as e:
            error.append(
                {"ename": type(e).__name__, "evalue": str(e), "traceback": traceback.format_exception(e)}
            )
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results.append(
            {"stdout": out.getvalue(), "stderr": err.getvalue(), "display": display, "error": error}
        )
    os.write(result_fd, json.dumps(results).encode())
    os._exit(0)


def _cells_ok(cells: Any, n: int) -> bool:
    """The cell results have the shape the child writes (the code shares its process and
    can write anything to that pipe: a malformed result is the code's failure)."""
    if not isinstance(cells, list) or len(cells) != n:
        return False
    for c in cells:
        if not isinstance(c, dict) or set(c) != {"stdout", "stderr", "display", "error"}:
            return False
        if not (isinstance(c["stdout"], str) and isinstance(c["stderr"], str)):
            return False
        if not (isinstance(c["display"], list) and isinstance(c["error"], list)):
            return False
        if not all(isinstance(x, dict) for x in c["display"] + c["error"]):
            return False
    return True


def handle_jupyter(req: dict[str, Any], n: int, cgroup_fd: int) -> dict[str, Any]:
    cwd = _scratch(n)
    try:
        _write_files(cwd, dict(req.get("files") or {}))
        cell_list = [str(c) for c in req["cells"]]
        r, w = os.pipe()
        t0 = time.monotonic()
        total = float(req.get("total_timeout", 45))
        pid = os.fork()
        if pid == 0:
            nul = os.open(os.devnull, os.O_RDWR)
            _enter_child(cgroup_fd, (nul, nul, nul), keep=w)
            try:
                _drop_privileges(cwd, int(req.get("memory_limit_mb", -1)), in_process=True)
                _jupyter_child(cell_list, float(req.get("cell_timeout", 0)), 3)
            finally:
                os._exit(1)
        os.close(w)
        data = bytearray()
        deadline = t0 + total
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                break
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            data += chunk
            if len(data) > 256 * 1024 * 1024:
                break
        os.close(r)
        status = _reap(pid, deadline)
        timed_out = status is None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        if status is None:
            status = os.waitpid(pid, 0)[1]
        code_ = os.waitstatus_to_exitcode(status)
        cells: Any = None
        stderr = ""
        if not timed_out:
            try:
                cells = json.loads(data) if data else None
            except ValueError:
                cells = None
            if cells is not None and not _cells_ok(cells, len(cell_list)):
                cells = None
            if cells is None:
                stderr = "the code ended its kernel or corrupted the cell results"
        ok = not timed_out and code_ == 0 and cells is not None
        driver = {
            "status": "TimeLimitExceeded" if timed_out else ("Finished" if ok else "Error"),
            "execution_time": round(time.monotonic() - t0, 6),
            "return_code": None if timed_out else code_,
            "stdout": "",
            "stderr": stderr,
        }
        files = _fetch_files(cwd, list(req.get("fetch_files") or []), cgroup_fd)
        return {"driver": driver, "cells": cells, "files": files}
    finally:
        _cleanup(cwd)


def _recv_request(chan: socket.socket, buf: bytearray) -> tuple[bytes, list[int]] | None:
    """One request line and the descriptors that came with it; None at EOF."""
    fds: list[int] = []
    start = 0
    while (end := buf.find(b"\n", start)) < 0:
        start = len(buf)
        data, got, flags, _ = socket.recv_fds(chan, 65536, 4, socket.MSG_CMSG_CLOEXEC)
        fds += got
        if flags & socket.MSG_CTRUNC:
            raise OSError("descriptors were cut from a request")
        if not data:
            for fd in fds:
                os.close(fd)
            return None
        buf += data
    line = bytes(buf[:end])
    del buf[: end + 1]
    return line, fds


def _send(chan: socket.socket, reply: dict[str, Any]) -> None:
    chan.sendall(json.dumps(reply).encode() + b"\n")


def main() -> None:
    global _CHAN
    _nondumpable()
    chan = _CHAN = socket.socket(fileno=os.dup(0))  # os.dup: close-on-exec
    nul = os.open(os.devnull, os.O_RDWR)
    os.dup2(nul, 0)
    os.dup2(2, 1)
    os.close(nul)
    os.makedirs(SCRATCH_ROOT, exist_ok=True)
    os.chmod(SCRATCH_ROOT, 0o711)
    # The code may write only its scratch directory: close the shared temp dirs to it.
    for shared in ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run/lock", "/var/lock"):
        with contextlib.suppress(OSError):
            os.chmod(shared, 0o1770)
    with open("/etc/passwd", "r+") as f:
        if f"x:{RUN_UID}:" not in f.read():
            f.write(f"runner:x:{RUN_UID}:{RUN_UID}:fncall runner:{SCRATCH_ROOT}:/bin/sh\n")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    _preload()
    _send(chan, {"ready": True})
    buf = bytearray()
    n = 0
    while (got := _recv_request(chan, buf)) is not None:
        n += 1
        line, fds = got
        req = json.loads(line)
        call_id = req.pop("id", None)
        try:
            reply: dict[str, Any]
            if len(fds) != 1:
                reply = {
                    "error": f"a request needs one cgroup descriptor, got {len(fds)}",
                    "error_kind": "runner",
                }
            else:
                _sweep()
                op = handle_jupyter if req.get("op") == "jupyter" else handle_run
                reply = op(req, n, fds[0])
        except Exception as e:
            reply = {"error": f"runner failure: {type(e).__name__}: {e}", "error_kind": "runner"}
        finally:
            for fd in fds:
                os.close(fd)
        reply["id"] = call_id
        reply["healthy"] = _healthy() and len(fds) == 1
        _send(chan, reply)


if __name__ == "__main__":
    main()
