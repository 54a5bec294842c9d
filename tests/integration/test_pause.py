"""Pause and resume on a real edge: frozen processes, reclaimed memory, transparent resume."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import pytest

from dsec.models import ExecRequest, SandboxSpec, SandboxState, SessionCreate, SessionRun

pytestmark = [pytest.mark.root, pytest.mark.asyncio]


def _evict(directory: Path) -> None:
    """Drop the page cache of the regular files in `directory` (not recursive)."""
    if not directory.is_dir():
        return
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


async def test_pause_frees_memory_and_resume_keeps_state(edge):
    sb = await edge.create(SandboxSpec(image="python", memory_mb=1024))
    s = await edge.session_create(sb.id, SessionCreate(kind="python"))
    await edge.session_run(sb.id, s.id, SessionRun(code="import numpy\ncounter = 41"))
    # page cache charged to the sandbox: read the image's libraries, after evicting them on the
    # host (a page stays charged to whichever cgroup read it first, e.g. the image build)
    for layer in edge.layers.lowerdirs(edge.layers.get_image("python")):
        for sub in ("usr/lib/x86_64-linux-gnu", "usr/bin"):
            _evict(layer / sub)
    await edge.exec(
        sb.id, ExecRequest(cmd="cat /usr/lib/x86_64-linux-gnu/*.so* /usr/bin/* > /dev/null 2>&1; true")
    )
    # a process that keeps counting while it runs
    await edge.exec(
        sb.id,
        ExecRequest(
            cmd="nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/tick; "
            "sleep 0.05; done' >/dev/null 2>&1 &"
        ),
    )
    await asyncio.sleep(0.3)
    before = edge.cgroups.memory_bytes(sb.id)
    info = await edge.pause(sb.id)
    assert info.state is SandboxState.PAUSED
    assert edge.cgroups.is_frozen(sb.id)
    after = edge.cgroups.memory_bytes(sb.id)
    assert after < before * 0.7, (before, after)
    # frozen: the ticker does not advance (read from the host, which does not resume it)
    t1 = edge.sandboxes[sb.id].files.read("/tmp/tick")
    await asyncio.sleep(0.3)
    assert edge.sandboxes[sb.id].files.read("/tmp/tick") == t1
    assert edge.get(sb.id).state is SandboxState.PAUSED  # looking does not resume
    # any operation resumes transparently, and quickly
    t0 = time.perf_counter()
    r = await edge.session_run(sb.id, s.id, SessionRun(code="counter + 1"))
    assert r.output.strip() == "42"
    assert time.perf_counter() - t0 < 1.0
    assert edge.get(sb.id).state is SandboxState.RUNNING
    assert edge.get(sb.id).timings_ms["resume"] < 50
    await asyncio.sleep(0.3)
    assert edge.sandboxes[sb.id].files.read("/tmp/tick") != t1  # it runs again


async def test_pause_project_and_idle_ttl_pause(edge):
    a = await edge.create(SandboxSpec(image="python", project="job1"))
    b = await edge.create(SandboxSpec(image="python", project="job1"))
    c = await edge.create(SandboxSpec(image="python", project="job2"))
    paused = await edge.pause_project("job1")
    assert sorted(paused) == sorted([a.id, b.id])
    assert [edge.get(x.id).state for x in (a, b, c)] == [
        SandboxState.PAUSED,
        SandboxState.PAUSED,
        SandboxState.RUNNING,
    ]
    d = await edge.create(SandboxSpec(image="python", ttl_idle_s=0.3, ttl_action="pause"))
    await asyncio.sleep(0.5)
    await edge.reap_idle()
    assert edge.get(d.id).state is SandboxState.PAUSED
    r = await edge.exec(d.id, ExecRequest(cmd="echo back"))
    assert r.stdout == "back\n"
    # stopping a paused sandbox works and leaves nothing
    await edge.stop(a.id)
    assert a.id not in edge.sandboxes
