"""One error tree for the whole platform, and its wire codes.

Every error has a stable ``code`` (sent on the wire), an HTTP ``status`` and a
message that tells the caller what to change. Clients rebuild the exact class
from the code with :func:`error_from_wire`.

    DsecError
     ├── InvalidRequest (400, also ValueError)
     │    ├── PayloadTooLarge (413)
     │    └── UnsupportedOperation (400)
     ├── AuthError (401, also PermissionError)
     │    └── Forbidden (403)
     ├── NotFound (404, also LookupError)
     │    ├── SandboxNotFound
     │    ├── SessionNotFound
     │    ├── ImageNotFound
     │    ├── LayerNotFound
     │    ├── CheckpointNotFound
     │    └── FileNotFound (also FileNotFoundError)
     ├── Conflict (409)
     │    ├── EditMismatch          old string not found exactly once
     │    ├── SandboxNotRunning
     │    ├── TrajectoryDivergence  a tagged step differs from the logged one
     │    └── FileExists_ (also FileExistsError)
     ├── SandboxFailed (410)                       the sandbox itself died: an environment fault
     ├── SandboxLost (410)                         its node stopped answering: given up
     ├── PathEscape (403, also PermissionError)   a path leaves the sandbox
     ├── QuotaExceeded (429)
     ├── CapacityExhausted (503)                   the edge or cluster is full
     ├── GraderUnavailable (503)                   a grader (verify, trusted exec) could not run
     ├── ExecTimeout (408, also TimeoutError)
     ├── Unavailable (503)                         transient: safe to retry
     └── InternalError (500)                       a platform bug or host failure
          └── LayerCorrupted                       a pulled layer does not match its digest
"""

from __future__ import annotations

from typing import Any, ClassVar


class DsecError(Exception):
    """Root of every dsec error."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init_subclass__(
        cls,
        *,
        code: str | None = None,
        status: int | None = None,
        retryable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Each error below declares its wire ``code`` (``class X(NotFound, code="x_not_found")``);
        what a class does not declare it inherits."""
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status
        if retryable is not None:
            cls.retryable = retryable

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class InvalidRequest(DsecError, ValueError, code="invalid_request", status=400): ...


class PayloadTooLarge(InvalidRequest, code="payload_too_large", status=413): ...


class UnsupportedOperation(InvalidRequest, code="unsupported_operation", status=400): ...


class AuthError(DsecError, PermissionError, code="unauthenticated", status=401): ...


class Forbidden(AuthError, code="forbidden", status=403): ...


class NotFound(DsecError, LookupError, code="not_found", status=404): ...


class SandboxNotFound(NotFound, code="sandbox_not_found"): ...


class SessionNotFound(NotFound, code="session_not_found"): ...


class ImageNotFound(NotFound, code="image_not_found"): ...


class LayerNotFound(NotFound, code="layer_not_found"): ...


class CheckpointNotFound(NotFound, code="checkpoint_not_found"): ...


class FileNotFound(NotFound, FileNotFoundError, code="file_not_found"): ...


class Conflict(DsecError, code="conflict", status=409): ...


class EditMismatch(Conflict, code="edit_mismatch"): ...


class SandboxFailed(DsecError, code="sandbox_failed", status=410):
    """The sandbox itself died (its init exited or was killed, e.g. out of memory): an
    environment failure, not the task's. Create a new sandbox."""


class SandboxLost(DsecError, code="sandbox_lost", status=410):
    """The sandbox's node stopped answering (its edge was killed or cut off) and the control
    plane gave it up: an environment fault, not the task's. Its quota is released; create a
    new sandbox (replay its trajectory there to go on)."""


class SandboxNotRunning(Conflict, code="sandbox_not_running"): ...


class TrajectoryDivergence(Conflict, code="trajectory_divergence"): ...


class FileExists_(Conflict, FileExistsError, code="file_exists"): ...


class PathEscape(DsecError, PermissionError, code="path_escape", status=403): ...


class QuotaExceeded(DsecError, code="quota_exceeded", status=429): ...


class CapacityExhausted(DsecError, code="capacity_exhausted", status=503, retryable=True): ...


class GraderUnavailable(DsecError, code="grader_unavailable", status=503):
    """A verify or trusted exec could not run its command (the platform could not set it up,
    or its helper failed): an environment fault, never the task's result. Nothing the agent
    does to its sandbox (its disk, inodes, pids or memory exhausted) causes it; see the
    message for the host's reason."""


class ExecTimeout(DsecError, TimeoutError, code="exec_timeout", status=408): ...


class Unavailable(DsecError, code="unavailable", status=503, retryable=True): ...


class InternalError(DsecError, code="internal", status=500): ...


class LayerCorrupted(InternalError, code="layer_corrupted"):
    """A layer from a registry or another edge whose bytes or tree do not match its digest
    (nothing of it was committed)."""


def _all_subclasses(cls: type[DsecError]) -> list[type[DsecError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


ERROR_CODES: dict[str, type[DsecError]] = {c.code: c for c in _all_subclasses(DsecError)}


def error_from_wire(status: int, body: Any) -> DsecError:
    """Rebuild the error a server sent; unknown codes fall back by status."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        cls = ERROR_CODES.get(err["code"])
        message = str(err.get("message", ""))
        details = err.get("details") or {}
        if cls is not None:
            return cls(message, **details)
    else:
        message = str(body)[:500]
    for cls in (InvalidRequest, AuthError, Forbidden, NotFound, Conflict, QuotaExceeded, Unavailable):
        if cls.status == status:
            return cls(message)
    if status >= 500:
        return Unavailable(message) if status in (502, 503, 504) else InternalError(message)
    return DsecError(message)
