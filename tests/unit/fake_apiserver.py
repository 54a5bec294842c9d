"""A stand-in apiserver for the SDK's failover tests: real HTTP/1.1 keep-alive on a free
loopback port, an answer of the right shape to every call the SDK makes, each request logged.

    python fake_apiserver.py LOG [CUT_FROM]

Prints its port once it listens. Each request is appended to LOG as one JSON line
``{"method", "path", "body"}`` before it is answered. From request number CUT_FROM on
(1-based), none is answered: once logged, its connection is closed, as an apiserver killed
while it held the call would (the kill itself is the caller's: SIGKILL by pid).
Standard library only (it starts in a few milliseconds): the shapes follow dsec.models.
"""

from __future__ import annotations

import io
import json
import re
import socket
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

SB = r"/v1/sandboxes/[^/]+"
INFO = {
    "id": "sb1",
    "state": "running",
    "spec": {"image": "python"},
    "edge": "n0",
    "created_at": 1.0,
    "last_active": 2.0,
}
EXEC = {"stdout": "ok\n", "stderr": "", "exit_code": 0, "duration": 0.01}
STAT = {
    "path": "/work/a",
    "name": "a",
    "type": "file",
    "size": 2,
    "mode": 420,
    "mtime": 1.0,
    "uid": 0,
    "gid": 0,
}
SNAP = {
    "id": "snap1",
    "sandbox": "sb1",
    "layer": "l1",
    "size_bytes": 1,
    "files": 1,
    "scrubbed": [],
    "created_at": 1.0,
}
CHECKPOINT = {
    "id": "ck1",
    "sandbox": "sb1",
    "project": "p",
    "image": "python",
    "cpu": 1.0,
    "memory_mb": 64,
    "trees": [],
    "size_bytes": 1,
    "leave_running": True,
    "created_at": 1.0,
}
BURST = {
    "id": "b1",
    "project": "p",
    "image": "python",
    "backend": "container",
    "cpu": 1.0,
    "memory_mb": 64,
    "count": 1,
    "when": 1.0,
    "announced_at": 1.0,
    "announced_by": "me",
    "state": "scheduled",
}
TRAJECTORY = {"entries": [], "stats": {"acknowledged": 0, "recorded": 0, "lost": 0, "pending": 0}}
SSE = f'event: stdout\ndata: "ok\\n"\n\nevent: result\ndata: {json.dumps(EXEC)}\n\n'


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        entry = tarfile.TarInfo("a")
        entry.size = 2
        tf.addfile(entry, io.BytesIO(b"ok"))
    return buf.getvalue()


# (method, path pattern, answer): the first that matches answers; None is 204.
BUILD_EVENTS = b'{"type": "log", "line": "1/1"}\n{"type": "result", "image": {"name": "x"}}\n'
ROUTES: list[tuple[str, str, Any]] = [
    ("POST", "/v1/sandboxes", INFO),
    ("POST", "/v1/sandboxes/batch", lambda body: {"sandboxes": [INFO] * body["count"], "errors": []}),
    ("POST", "/v1/sandboxes/batch_stop", {"errors": {}}),
    ("GET", "/v1/sandboxes", {"sandboxes": [INFO]}),
    ("GET", SB, INFO),
    ("DELETE", SB, None),
    ("POST", SB + "/exec", EXEC),
    ("POST", SB + "/exec/stream", SSE),
    ("POST", SB + "/verify", EXEC),
    ("POST", SB + "/sessions", {"id": "s1", "kind": "bash"}),
    ("GET", SB + "/sessions", {"sessions": [{"id": "s1", "kind": "bash"}]}),
    ("POST", SB + "/sessions/[^/]+/run", {"output": "ok\n", "exit_code": 0, "duration": 0.01}),
    ("DELETE", SB + "/sessions/[^/]+", None),
    ("GET", SB + "/files", {"path": "/work/a", "content": "ok", "encoding": "utf-8", "size": 2}),
    ("PUT", SB + "/files", None),
    ("DELETE", SB + "/files", None),
    ("POST", SB + "/files/edit", {"size": 2}),
    ("GET", SB + "/files/stat", STAT),
    ("GET", SB + "/files/list", {"entries": [STAT]}),
    ("PUT", SB + "/archive", None),
    ("GET", SB + "/archive", _tar()),
    ("GET", SB + "/trajectory", TRAJECTORY),
    ("GET", SB + "/trajectory/export", b"{}\n"),
    ("POST", SB + "/(pause|resume)", INFO),
    ("POST", SB + "/snapshot", SNAP),
    ("POST", SB + "/fork", {"sandboxes": [INFO]}),
    ("(GET|PUT|DELETE)", SB + "/network", {"policy": None}),
    ("POST", SB + "/protect", {"protected": ["/work/g"]}),
    ("POST", SB + "/checkpoint", CHECKPOINT),
    ("GET", "/v1/checkpoints", {"checkpoints": [CHECKPOINT]}),
    ("POST", "/v1/checkpoints/[^/]+/restore", INFO),
    ("DELETE", "/v1/(checkpoints|snapshots)/[^/]+", None),
    ("GET", "/v1/snapshots", {"snapshots": []}),
    ("GET", "/v1/images", {"images": []}),
    ("GET", "/v1/backends", {"backends": []}),
    ("GET", "/v1/edges", {"edges": []}),
    ("GET", "/v1/health", {"status": "ok"}),
    ("GET", "/v1/version", {"version": "1"}),
    ("POST", "/v1/projects/[^/]+/pause", {"paused": ["sb1"]}),
    ("POST", "/v1/pools/prewarm", {"ready": 1}),
    ("POST", "/v1/edges/[^/]+/(drain|undrain)", {"draining": True}),
    ("GET", "/v1/images/.+", {"name": "p/x:1", "layers": [], "created_at": 0.0}),
    ("DELETE", "/v1/images/.+", None),
    ("POST", "/v1/images/build", BUILD_EVENTS),
    ("POST", "/v1/images/pull", {"name": "p/x:1", "layers": [], "created_at": 0.0}),
    ("PUT", "/v1/projects/[^/]+/registries/[^/]+", None),
    ("GET", "/v1/projects/[^/]+/registries", {"registries": []}),
    ("DELETE", "/v1/projects/[^/]+/registries/[^/]+", None),
    ("POST", "/v1/capacity", BURST),
    ("GET", "/v1/capacity", {"bursts": [BURST]}),
    ("DELETE", "/v1/capacity/[^/]+", {**BURST, "state": "cancelled"}),
    ("POST", "/v1/(token|principals/[^/]+)/rotate", {"token": "t2"}),
    ("POST", "/v1/(token|principals/[^/]+)/revoke", None),
    ("GET", "/v1/principals/me", {"principal": {"id": "u1", "name": "me"}}),
]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    disable_nagle_algorithm = True  # (head and body are two writes)
    log_path = ""
    cut_from = 0
    count = 0
    lock = threading.Lock()

    def _handle(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(size) if size else b""
        path = urlsplit(self.path).path
        with self.lock:
            Handler.count += 1
            with open(self.log_path, "a") as log:
                log.write(
                    json.dumps({"method": self.command, "path": path, "body": raw.decode("latin-1")}) + "\n"
                )
            cut = 0 < self.cut_from <= self.count
        if cut:
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        for method, pattern, answer in ROUTES:
            if re.fullmatch(method, self.command) and re.fullmatch(pattern, path):
                if callable(answer):
                    answer = answer(json.loads(raw))
                return self._reply(answer, path.endswith("/stream"))
        self._reply(
            {"error": {"code": "not_found", "message": f"no route {self.command} {path}"}}, status=404
        )

    def _reply(self, answer: Any, sse: bool = False, status: int = 200) -> None:
        if answer is None:
            self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if isinstance(answer, bytes):
            data, kind = answer, "application/octet-stream"
        elif sse:
            data, kind = answer.encode(), "text/event-stream"
        else:
            data, kind = json.dumps(answer).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    Handler.log_path = sys.argv[1]
    Handler.cut_from = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
