"""The Python session's driver: the code that runs in the sandbox's interpreter and
answers each run on pipes of that run, with a nonce."""

from __future__ import annotations

# --- python: the driver --------------------------------------------------------------------

PY_DRIVER = r"""
def _dsec_driver():
    import ast, builtins, io, os, signal, socket, sys, traceback, types
    compile_, exec_, eval_, isinstance_, len_, repr_, print_ = (
        builtins.compile, builtins.exec, builtins.eval, builtins.isinstance, builtins.len,
        builtins.repr, builtins.print)
    Expr, Expression, ONLY_AST = ast.Expr, ast.Expression, ast.PyCF_ONLY_AST
    read, write, close, dup2 = os.read, os.write, os.close, os.dup2
    format_exc, from_bytes = traceback.format_exc, int.from_bytes
    ctl = socket.socket(fileno=os.dup(0))
    recvmsg = ctl.recvmsg
    CMSG = socket.CMSG_SPACE(3 * 4)
    SOL, RIGHTS, CLOEXEC = socket.SOL_SOCKET, socket.SCM_RIGHTS, socket.MSG_CMSG_CLOEXEC
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
        b = s.encode("utf-8", "replace")
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
            try:
                body = run(b"".join(chunks).decode("utf-8", "surrogateescape"), cap)
            except KeyboardInterrupt:
                body = bytes([1]) + field("") + field("") + field("KeyboardInterrupt")
            dup2(nul, 1); dup2(nul, 2)
            reply = b"DSEC" + nonce + len_(body).to_bytes(4, "little") + body
            while reply:
                reply = reply[write(reply_fd, reply):]
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
