"""A dsec sandbox behind the sandbox protocols of rLLM and Harbor.

Mirrors rLLM's sandbox protocol::

    exec(command, timeout=None, user=None) -> str      # stdout, then stderr
    upload_file(local_path, remote_path); upload_dir(local_dir, remote_dir)
    close(); is_alive() -> bool

and, synchronously, Harbor's ``BaseEnvironment``::

    start(); stop()
    upload_file / upload_dir / download_file / download_dir
    exec(command, cwd, env, timeout_sec, user) -> ExecResult{stdout, stderr, return_code}

Harbor's ``exec`` is :meth:`DsecSandbox.exec_result` here (``exec`` returns the rLLM
string). Harbor's own methods are coroutines; wrap these with ``asyncio.to_thread``
there. Directory transfers copy the *contents*: ``upload_dir("a", "/work/b")`` makes
``/work/b/<each entry of a>``, and ``download_dir`` is the converse.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from dsec import errors
from dsec.client import Client, Sandbox
from dsec.models import SandboxState

__all__ = ["DsecSandbox", "SandboxExecResult"]


@dataclass(frozen=True)
class SandboxExecResult:
    """Harbor's ``ExecResult``, plus whether the command hit its timeout."""

    stdout: str | None
    stderr: str | None
    return_code: int
    timed_out: bool = False


class DsecSandbox:
    """One dsec sandbox, started by :meth:`start` (or the first call) and stopped by :meth:`close`.

    Pass ``sandbox_id`` to attach to an existing sandbox instead of creating one, and
    ``client`` to share a :class:`Client` (otherwise one is opened with the SDK defaults).
    """

    def __init__(
        self,
        image: str = "python",
        *,
        client: Client | None = None,
        sandbox_id: str | None = None,
        cpu: float = 1.0,
        memory_mb: int = 1024,
        env: dict[str, str] | None = None,
        workdir: str = "/work",
        ttl_idle_s: float | None = 900.0,
        default_timeout: float = 60.0,
    ) -> None:
        self.image = image
        self.default_timeout = default_timeout
        self._client = client
        self._owns_client = client is None
        self._spec: dict[str, Any] = {
            "cpu": cpu,
            "memory_mb": memory_mb,
            "env": env,
            "workdir": workdir,
            "ttl_idle_s": ttl_idle_s,
        }
        self._sandbox: Sandbox | None = None
        self._attach_id = sandbox_id
        self._closed = False

    @property
    def id(self) -> str | None:
        return self._sandbox.id if self._sandbox else self._attach_id

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Create (or attach to) the sandbox. Idempotent; fails after :meth:`close`."""
        if self._closed:
            raise RuntimeError("this DsecSandbox is closed")
        if self._sandbox is not None:
            return
        if self._client is None:
            self._client = Client()
        if self._attach_id is not None:
            self._sandbox = self._client.get(self._attach_id)
        else:
            self._sandbox = self._client.create(self.image, labels={"dsec-adapter": "sandbox"}, **self._spec)

    def close(self) -> None:
        """Stop the sandbox and close the client it opened. Idempotent."""
        sandbox, self._sandbox, self._closed = self._sandbox, None, True
        try:
            if sandbox is not None:
                sandbox.stop()
        finally:
            if self._client is not None and self._owns_client:
                self._client.close()
                self._client = None

    stop = close

    def is_alive(self) -> bool:
        """Whether the sandbox exists and is running (or paused: any request resumes it)."""
        if self._closed or self._sandbox is None:
            return False
        try:
            info = self._sandbox.refresh()
        except errors.NotFound:
            return False
        return info.state in (SandboxState.RUNNING, SandboxState.PAUSED)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ commands

    def exec(
        self,
        command: str,
        timeout: float | None = None,
        user: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        """rLLM: run ``command`` with bash; returns stdout followed by stderr."""
        r = self.exec_result(command, cwd=cwd, env=env, timeout_sec=timeout, user=user)
        return (r.stdout or "") + (r.stderr or "")

    def exec_result(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: float | None = None,
        user: str | None = None,
    ) -> SandboxExecResult:
        """Harbor: run ``command`` with bash; returns stdout, stderr and the return code."""
        timeout = timeout_sec if timeout_sec is not None else self.default_timeout
        r = self._box().exec(["bash", "-c", command], timeout=timeout, cwd=cwd, env=env, user=user)
        return SandboxExecResult(
            stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code, timed_out=r.timed_out
        )

    # ------------------------------------------------------------------ files

    def upload_file(self, local_path: str | Path, remote_path: str) -> None:
        """Copy one local file to ``remote_path`` (a file path), creating parent directories."""
        self._box().files.write(remote_path, Path(local_path).read_bytes())

    def upload_dir(self, local_dir: str | Path, remote_dir: str) -> None:
        """Copy the contents of ``local_dir`` into ``remote_dir``, creating it."""
        src = Path(local_dir)
        if not src.is_dir():
            raise NotADirectoryError(f"{src} is not a local directory")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for child in sorted(src.iterdir()):
                tf.add(child, arcname=child.name, recursive=True)
        self._box().files.upload_tar(buf.getvalue(), remote_dir)

    def download_file(self, remote_path: str, local_path: str | Path) -> None:
        """Copy one sandbox file to ``local_path`` (a file path), creating parent directories."""
        dest = Path(local_path)
        data = self._box().files.read_bytes(remote_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)

    def download_dir(self, remote_dir: str, local_dir: str | Path) -> None:
        """Copy the contents of ``remote_dir`` into ``local_dir``, creating it."""
        self._box().files.download(remote_dir, local_dir)

    # ------------------------------------------------------------------ internals

    def _box(self) -> Sandbox:
        if self._sandbox is None:
            self.start()
        assert self._sandbox is not None
        return self._sandbox
