"""The fncall runner: a resident process inside a worker sandbox that runs one call at a time.

This file is shipped into the sandbox as the source of `python3 -c` (stdlib only;
it must run on the image's Python) and speaks JSON lines on its stdin/stdout:

    request  {"op": "run", "language", "code", "stdin", "files": {rel path: base64},
              "fetch_files": [rel path], "compile_timeout", "run_timeout",
              "memory_limit_mb", "max_output"}
             {"op": "jupyter", "cells": [str], "cell_timeout", "total_timeout", ...}
    reply    {"compile": Stage|None, "run": Stage|None, "files": {...}, "healthy": bool, ...}

Each call gets a fresh scratch directory and fresh processes: the runner forks, the
child drops to an unprivileged uid (it can write only its scratch directory: /tmp,
/var/tmp and /dev/shm are closed to it), sets rlimits and runs the code; Python code
runs in the forked child of this already-warm interpreter (no interpreter start).
After the call every process of that uid is killed and the scratch is removed, so
nothing is left for the next call.
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

# language -> (source file, compile argv or None, run argv; "PYTHON" = in-process fast path)
LANGUAGES: dict[str, tuple[str, list[str] | None, list[str]]] = {
    "python": ("main.py", None, ["PYTHON"]),
    "pytest": ("test_main.py", None, ["PYTEST"]),
    "bash": ("main.sh", None, ["bash", "main.sh"]),
    "c": ("main.c", ["gcc", "-O2", "-std=c11", "-o", "main", "main.c", "-lm"], ["./main"]),
    "cpp": ("main.cpp", ["g++", "-O2", "-std=c++17", "-o", "main", "main.cpp", "-lm"], ["./main"]),
    "nodejs": ("main.js", None, ["node", "main.js"]),
}


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
    argv: list[str], code: str, cwd: str, stdin: bytes, timeout: float, memory_mb: int, max_output: int
) -> dict[str, Any]:
    """Fork, run `argv` (or the in-process Python path), collect output; a Stage dict."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            for fd, target in ((in_r, 0), (out_w, 1), (err_w, 2)):
                os.dup2(fd, target)
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            _drop_privileges(cwd, memory_mb, in_process=argv[0] in ("PYTHON", "PYTEST"))
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


def _fetch_files(cwd: str, names: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for rel in names:
        target = os.path.realpath(os.path.join(cwd, rel))
        if not target.startswith(cwd + "/") or not os.path.isfile(target):
            out[rel] = None
            continue
        with open(target, "rb") as f:
            out[rel] = base64.b64encode(f.read(16 * 1024 * 1024)).decode()
    return out


def _cleanup(cwd: str) -> None:
    # Anything the call left running as RUN_UID dies (the runner is root; the code
    # cannot signal it), then the scratch goes.
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


def handle_run(req: dict[str, Any], n: int) -> dict[str, Any]:
    lang = req.get("language") or "python"
    if lang not in LANGUAGES:
        return {
            "error": f"unsupported language {lang!r}; supported: {', '.join(sorted(LANGUAGES))}",
            "error_kind": "unsupported_language",
        }
    source, compile_argv, run_argv = LANGUAGES[lang]
    cwd = _scratch(n)
    try:
        files = dict(req.get("files") or {})
        files[source] = base64.b64encode(req["code"].encode()).decode()
        _write_files(cwd, files)
        cap = int(req.get("max_output", 1 << 20))
        mem = int(req.get("memory_limit_mb", -1))
        compile_stage = None
        if compile_argv is not None:
            compile_stage = run_stage(
                compile_argv, "", cwd, b"", float(req.get("compile_timeout", 10)), -1, cap
            )
            if compile_stage["status"] != "Finished":
                return {"compile": compile_stage, "run": None, "files": {}}
        stdin = (req.get("stdin") or "").encode()
        run = run_stage(run_argv, req["code"], cwd, stdin, float(req.get("run_timeout", 10)), mem, cap)
        return {
            "compile": compile_stage,
            "run": run,
            "files": _fetch_files(cwd, req.get("fetch_files") or []),
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


def handle_jupyter(req: dict[str, Any], n: int) -> dict[str, Any]:
    cwd = _scratch(n)
    try:
        _write_files(cwd, dict(req.get("files") or {}))
        r, w = os.pipe()
        t0 = time.monotonic()
        total = float(req.get("total_timeout", 45))
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                _drop_privileges(cwd, int(req.get("memory_limit_mb", -1)), in_process=True)
                _jupyter_child(list(req["cells"]), float(req.get("cell_timeout", 0)), w)
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
        os.close(r)
        status = _reap(pid, deadline)
        timed_out = status is None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        if timed_out:
            os.waitpid(pid, 0)
        cells = json.loads(data) if data and not timed_out else None
        driver = {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": round(time.monotonic() - t0, 6),
            "return_code": None if timed_out else 0,
            "stdout": "",
            "stderr": "",
        }
        return {"driver": driver, "cells": cells, "files": _fetch_files(cwd, req.get("fetch_files") or [])}
    finally:
        _cleanup(cwd)


def main() -> None:
    chan_in = os.fdopen(os.dup(0), "rb")
    chan_out = os.fdopen(os.dup(1), "wb")
    nul = os.open(os.devnull, os.O_RDWR)
    os.dup2(nul, 0)
    os.dup2(2, 1)
    os.makedirs(SCRATCH_ROOT, exist_ok=True)
    os.chmod(SCRATCH_ROOT, 0o711)
    # The code may write only its scratch directory: close the shared temp dirs to it.
    for shared in ("/tmp", "/var/tmp", "/dev/shm"):
        with contextlib.suppress(OSError):
            os.chmod(shared, 0o1770)
    with open("/etc/passwd", "r+") as f:
        if f"x:{RUN_UID}:" not in f.read():
            f.write(f"runner:x:{RUN_UID}:{RUN_UID}:fncall runner:{SCRATCH_ROOT}:/bin/sh\n")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    _preload()
    chan_out.write(b'{"ready": true}\n')
    chan_out.flush()
    for n, line in enumerate(chan_in, 1):
        req = json.loads(line)
        try:
            reply = handle_jupyter(req, n) if req.get("op") == "jupyter" else handle_run(req, n)
        except Exception as e:
            reply = {"error": f"runner failure: {type(e).__name__}: {e}", "error_kind": "runner"}
        reply["healthy"] = _healthy()
        chan_out.write(json.dumps(reply).encode() + b"\n")
        chan_out.flush()


if __name__ == "__main__":
    main()
