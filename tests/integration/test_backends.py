"""The backend interface (issue #12): backends by name, declared capabilities, and an
operation a backend lacks answered with `unsupported_operation` naming the backend and the
operation, on a real edge with real sandboxes.

The restricted backend here is the container backend with fewer declared capabilities,
registered under another name the way a plugin would register its own: the sandboxes are
real, only the declaration differs."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec import errors
from dsec.backends import registry
from dsec.backends.base import Capability
from dsec.backends.container import ContainerBackend
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


class FilesOnlyContainers(ContainerBackend):
    name = "container-lite"
    capabilities = frozenset({Capability.EXEC, Capability.FILES, Capability.TELEMETRY})


@pytest.fixture
async def lite_edge(python_image: str, edge_dirs: dict[str, Path]) -> AsyncIterator[object]:
    from dsec.config import EdgeSettings
    from dsec.edge import Edge

    registry.register("container-lite", FilesOnlyContainers)
    settings = EdgeSettings(
        name="t" + secrets.token_hex(4),
        reconcile_interval_s=3600,
        fncall_image="",
        backends=["container", "container-lite"],
        **edge_dirs,
    )
    e = Edge(settings)
    await e.start()
    try:
        yield e
    finally:
        await e.close()
        registry.unregister("container-lite")


async def test_an_operation_the_backend_lacks_names_backend_and_operation(lite_edge):
    edge = lite_edge
    assert edge.status().backends == ["container", "container-lite"]
    sb = await edge.create(SandboxSpec(image="python", backend="container-lite"))
    r = await edge.exec(sb.id, ExecRequest(cmd="echo hi > /work/a; cat /work/a"))
    assert r.exit_code == 0 and r.stdout == "hi\n"
    assert await edge.read_file(sb.id, "/work/a") == b"hi\n"
    bg = await edge.exec(sb.id, ExecRequest(cmd="sleep 300 > /dev/null 2>&1 & echo $!"))
    for op, call in [
        ("fork", lambda: edge.fork(sb.id, 2)),
        ("pause", lambda: edge.pause(sb.id)),
        ("snapshot", lambda: edge.snapshot(sb.id)),
        ("checkpoint", lambda: edge.checkpoint(sb.id)),
        ("trusted exec", lambda: edge.exec(sb.id, ExecRequest(cmd="true", trusted=True))),
        ("trusted exec", lambda: edge.verify(sb.id, ExecRequest(cmd="true"))),
    ]:
        with pytest.raises(errors.UnsupportedOperation) as ei:
            await call()
        e = ei.value
        assert e.details["backend"] == "container-lite" and e.details["operation"] == op, e.details
        assert f"the container-lite backend does not support {op}" in e.message
        assert e.to_wire()["error"]["code"] == "unsupported_operation"
    # Nothing was left half-done: no fork children, the sandbox still runs and answers.
    assert [s.id for s in edge.list()] == [sb.id]
    assert (await edge.exec(sb.id, ExecRequest(cmd="cat /work/a"))).stdout == "hi\n"
    # verify was refused before it killed anything: the background process still runs
    alive = await edge.exec(sb.id, ExecRequest(cmd=f"kill -0 {bg.stdout.strip()} && echo alive"))
    assert alive.stdout == "alive\n", alive
    # The same operations on the default backend work.
    full = await edge.create(SandboxSpec(image="python"))
    assert len(await edge.fork(full.id, 1)) == 1
    await edge.pause(full.id)


async def test_an_unknown_or_unstarted_backend_is_a_clear_4xx(edge):
    for name in ("gvisor-nope", "container-lite"):
        with pytest.raises(errors.InvalidRequest) as ei:
            await edge.create(SandboxSpec(image="python", backend=name))
        assert ei.value.status == 400 and f"available: {', '.join(sorted(edge.backends))}" in ei.value.message
        assert ei.value.details["available"] == sorted(edge.backends)
    assert edge.sandboxes == {}
