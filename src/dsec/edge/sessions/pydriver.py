"""The Python session's driver: the code that runs in the sandbox's interpreter and
answers each run with a nonce, over one of two transports.

- `PY_DRIVER` (an init that passes descriptors: a container's, gVisor's): each run is one
  datagram on a control socket (fd 0) with the nonce and three fresh pipes, the code, the
  reply and the stray output (fd 1 and 2 during the run).
- `PY_DRIVER_STREAM` (a microVM's agent carries only stdio, as bytes): each run is a frame
  on stdin (``DSRQ``, the nonce, the cap, the code's length, the code) and its reply a frame
  on stdout; the stray output goes into a pipe the driver makes for that run (read by a
  thread of its own, capped) and comes back in the reply as a fourth field. Either way what
  a run's processes write after it ended goes into a closed pipe, never into a later run.
"""

from __future__ import annotations

_START = r"""
def _dsec_driver():
    import ast, builtins, io, os, signal, socket, sys, traceback, types
    compile_, exec_, eval_, isinstance_, len_, repr_, print_ = (
        builtins.compile, builtins.exec, builtins.eval, builtins.isinstance, builtins.len,
        builtins.repr, builtins.print)
    Expr, Expression, ONLY_AST = ast.Expr, ast.Expression, ast.PyCF_ONLY_AST
    read, write, close, dup2 = os.read, os.write, os.close, os.dup2
    format_exc, from_bytes = traceback.format_exc, int.from_bytes
"""

_SOCKET_SETUP = r"""
    ctl = socket.socket(fileno=os.dup(0))
    recvmsg = ctl.recvmsg
    CMSG = socket.CMSG_SPACE(3 * 4)
    SOL, RIGHTS, CLOEXEC = socket.SOL_SOCKET, socket.SCM_RIGHTS, socket.MSG_CMSG_CLOEXEC
"""

_STREAM_SETUP = r"""
    import _thread, select
    requests, replies = os.dup(0), os.dup(1)  # (not inherited: no child holds them)
    pipe, start_thread, lock, poll = os.pipe, _thread.start_new_thread, _thread.allocate_lock, select.select
"""

_COMMON = r"""
    nul = os.open(os.devnull, os.O_RDWR)
    dup2(nul, 0); dup2(nul, 1); dup2(nul, 2)
    sys.stdin = open(os.devnull)
    sys.stdout = sys.stderr = os.fdopen(os.dup(1), "w", buffering=1)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    ns = main.__dict__
    del globals()["_dsec_driver"]

    class Capped(io.TextIOBase):
        # keeps the first `cap` characters, counts the rest: a print flood costs no memory
        def __init__(self, cap):
            self.cap, self.parts, self.kept, self.over = cap, [], 0, False
        def writable(self):
            return True
        def write(self, s):
            room = self.cap - self.kept
            if room > 0:
                self.parts.append(s[:room]); self.kept += min(len_(s), room)
            if len_(s) > room:
                self.over = True
            return len_(s)
        def getvalue(self):
            return "".join(self.parts)

    def field(s):
        b = s.encode("utf-8", "replace") if isinstance_(s, str) else s
        return len_(b).to_bytes(4, "little") + b

    def run(code, cap):
        out, err = Capped(cap), Capped(cap)
        failed, error = False, ""
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        try:
            tree = compile_(code, "<session>", "exec", ONLY_AST)
            last = None
            if tree.body and isinstance_(tree.body[-1], Expr):
                last = Expression(tree.body.pop().value)
            exec_(compile_(tree, "<session>", "exec"), ns)
            if last is not None:
                value = eval_(compile_(last, "<session>", "eval"), ns)
                if value is not None:
                    print_(repr_(value), file=out)
        except BaseException:
            failed = True
            try:
                error = format_exc()[-cap:] or "error"
            except BaseException:
                error = "error (its traceback could not be formatted)"
        sys.stdout, sys.stderr = saved
        flags = (1 if failed else 0) | (2 if out.over or err.over else 0)
        return bytes([flags]) + field(out.getvalue()) + field(err.getvalue()) + field(error)

    def answer(fd, nonce, body):
        reply = b"DSEC" + nonce + len_(body).to_bytes(4, "little") + body
        while reply:
            reply = reply[write(fd, reply):]

    def one_run(code, cap):
        try:
            return run(code.decode("utf-8", "surrogateescape"), cap)
        except KeyboardInterrupt:
            return bytes([1]) + field("") + field("") + field("KeyboardInterrupt")
"""

_SOCKET_LOOP = r"""
    while True:
        fds = []
        try:
            msg, anc, _, _ = recvmsg(64, CMSG, CLOEXEC)
            for level, kind, data in anc:
                if level == SOL and kind == RIGHTS:
                    fds += [from_bytes(data[i:i + 4], "little") for i in range(0, len_(data) - 3, 4)]
            if not msg:
                break
            if len_(msg) != 28 or len_(fds) != 3:
                for fd in fds:
                    close(fd)
                continue
            nonce, cap = msg[:16], from_bytes(msg[16:24], "little")
            code_fd, reply_fd, out_fd = fds
            chunks = []
            while True:
                b = read(code_fd, 1 << 20)
                if not b:
                    break
                chunks.append(b)
            close(code_fd)
            dup2(out_fd, 1); dup2(out_fd, 2); close(out_fd)
            body = one_run(b"".join(chunks), cap)
            dup2(nul, 1); dup2(nul, 2)
            answer(reply_fd, nonce, body)
            close(reply_fd)
        except KeyboardInterrupt:
            for fd in fds:
                try:
                    close(fd)
                except OSError:
                    pass
        except OSError:
            for fd in fds:
                try:
                    close(fd)
                except OSError:
                    pass
_dsec_driver()
"""

_STREAM_LOOP = r"""
    def exactly(n):
        parts = []
        while n:
            b = read(requests, min(n, 1 << 20))
            if not b:
                raise EOFError
            parts.append(b); n -= len_(b)
        return b"".join(parts)

    def pump(r, cap, box, done):
        # the run's stray output, the first `cap` bytes kept, until the run ended and the
        # pipe holds nothing more (what a process it left writes later: a closed pipe)
        try:
            while True:
                if poll([r], [], [], 0.02)[0]:
                    b = read(r, 65536)
                    if not b:
                        break
                    if box[1] < cap:
                        box[0].append(b[:cap - box[1]])
                    box[1] += len_(b)
                elif box[2]:
                    break
        finally:
            done.release()

    while True:
        try:
            head = exactly(32)
            if head[:4] != b"DSRQ":
                break
            nonce, cap = head[4:20], from_bytes(head[20:28], "little")
            code = exactly(from_bytes(head[28:32], "little"))
        except (EOFError, OSError, KeyboardInterrupt):
            break
        r, w = pipe()
        dup2(w, 1); dup2(w, 2); close(w)
        box, done = [[], 0, False], lock()
        done.acquire()
        start_thread(pump, (r, cap, box, done))
        body = one_run(code, cap)
        dup2(nul, 1); dup2(nul, 2)
        box[2] = True
        done.acquire()
        close(r)
        body += field(b"".join(box[0])) + bytes([1 if box[1] > cap else 0])
        try:
            answer(replies, nonce, body)
        except (OSError, KeyboardInterrupt):
            break
_dsec_driver()
"""

PY_DRIVER = _START + _SOCKET_SETUP + _COMMON + _SOCKET_LOOP
PY_DRIVER_STREAM = _START + _STREAM_SETUP + _COMMON + _STREAM_LOOP
