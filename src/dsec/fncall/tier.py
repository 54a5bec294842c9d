"""The tier of a stateless call: fncall workers are container sandboxes (the pool gives each
call a cgroup of the host under its worker, which gVisor and microVM sandboxes do not have),
so a call naming another backend is refused, by the apiserver and again by the edge."""

from __future__ import annotations

from dsec import errors
from dsec.models import WORKER_BACKEND


def container_only(backend: str) -> None:
    """Refuse a call on any backend but the workers' own."""
    if backend != WORKER_BACKEND:
        raise errors.UnsupportedOperation(
            f"fncall runs on {WORKER_BACKEND} workers only, not on {backend!r}: to run code on "
            f"{backend!r}, create a sandbox with backend={backend!r} (POST /v1/sandboxes) and exec in it",
            reason="backend",
            backend=backend,
            operation="fncall",
        )
