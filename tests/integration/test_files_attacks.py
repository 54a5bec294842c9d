"""Attacks on the edge's file API from inside a sandbox (and by a caller): memory charged to
the host, reads and archives past their caps, listings that stall the event loop, deletes
across mounts, FIFOs and sockets, and the idle reaper taking a sandbox from under its exec."""

from __future__ import annotations

import asyncio
import inspect
import io
import tarfile
import time

import pytest

from dsec import errors
from dsec.models import ExecRequest, SandboxSpec

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

MiB = 1 << 20


async def aw(x):
    """The file calls were synchronous before they moved off the event loop."""
    return await x if inspect.isawaitable(x) else x


async def run(edge, sid, cmd, **kw):
    r = await edge.exec(sid, ExecRequest(cmd=cmd, **kw))
    return r


async def test_file_writes_are_charged_to_the_sandbox_memory(edge):
    """A 64 MiB sandbox with a big disk in memory (storage="memory": a tmpfs): writes through
    the API land in its tmpfs, so they must count against its memory, as its own processes'
    writes do (before: 768 MiB held). (On disk, the default, they are the disk's: ENOSPC at
    disk_mb, tests/integration/test_disk_storage.py.)"""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=64, disk_mb=2048, storage="memory"))
    chunk = b"\xa5" * (8 * MiB)
    written = 0
    with pytest.raises(errors.QuotaExceeded) as ei:
        for i in range(96):  # 768 MiB
            await aw(edge.write_file(sb.id, f"/work/fill{i}", chunk))
            written += len(chunk)
            used = edge.cgroups.memory_bytes(sb.id)
            assert used is not None and used >= written * 0.9, (used, written)
    assert written <= 64 * MiB, written
    assert "memory" in ei.value.message
    # the sandbox survives the refusal and keeps working; the failed file, new, is gone
    r = await run(edge, sb.id, f"echo alive; ls /work/fill{written // len(chunk)}")
    assert r.stdout.split() == ["alive"] and "No such file" in r.stderr, r
    # freeing its files gives the room back
    await run(edge, sb.id, "rm -f /work/fill*")
    await aw(edge.write_file(sb.id, "/work/again", chunk))


async def test_charged_write_never_kills_the_sandbox_processes(edge):
    """A process inside holds most of the memory; a large API write must fail on its own
    (the copier offers itself to the OOM killer first), not take that process down."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=96, disk_mb=2048, storage="memory"))
    hold = "import time; b = bytearray(60 << 20); b[::4096] = b'x' * len(b[::4096]); open('/tmp/ready','w').close(); time.sleep(120)"  # noqa: E501
    await run(edge, sb.id, ["sh", "-c", f'nohup python3 -c "{hold}" >/dev/null 2>&1 &'])
    for _ in range(100):
        if (await run(edge, sb.id, "test -e /tmp/ready")).exit_code == 0:
            break
        await asyncio.sleep(0.1)
    with pytest.raises(errors.QuotaExceeded):
        await aw(edge.write_file(sb.id, "/work/big", b"z" * (64 * MiB)))
    r = await run(edge, sb.id, "pgrep -f 'bytearray' >/dev/null && echo holder-alive")
    assert r.stdout.strip() == "holder-alive"


def _tar(files: list[tuple[str, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, size in files:
            info = tarfile.TarInfo(name)
            info.size = size
            tf.addfile(info, io.BytesIO(b"\x5a" * size))
    return buf.getvalue()


async def test_an_upload_past_the_sandbox_memory_is_refused_before_it_is_unpacked(edge):
    """Round three: a tar upload bigger than the memory its tmpfs files may take answered 400
    with an empty reason, left a partial file, and the OOM killer took the sandbox's init. Now
    it is a 429 quota_exceeded that names the limit, nothing is written, the sandbox lives on."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=128, disk_mb=2048))
    for files in ([("a.txt", 10), ("big.bin", 200 * MiB)], [("b.txt", 10), ("c", 60 * MiB), ("d", 60 * MiB)]):
        with pytest.raises(errors.QuotaExceeded) as ei:
            await edge.upload_tar(sb.id, "/work/up", _tar(files))
        assert "memory_mb=128" in ei.value.message, ei.value.message
    r = await run(edge, sb.id, "echo alive; ls -A /work/up 2>/dev/null")
    assert r.stdout.split() == ["alive"], r
    assert edge.get(sb.id).state == "running"
    await edge.upload_tar(sb.id, "/work/up", _tar([("fits.bin", 32 * MiB)]))  # room is still there
    r = await run(edge, sb.id, "stat -c %s /work/up/fits.bin")
    assert r.stdout.strip() == str(32 * MiB), r


async def test_a_failed_upload_removes_the_files_it_made_and_keeps_older_ones(edge):
    """The unpack itself runs out of room (the disk, which no size check up front can see
    once a process inside fills it meanwhile): the files the upload made are removed, the
    ones that were there before stay, and the answer is quota_exceeded, not invalid_request."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512, disk_mb=64))
    await aw(edge.write_file(sb.id, "/work/up/old.txt", b"keep me"))
    with pytest.raises(errors.QuotaExceeded) as ei:
        await edge.upload_tar(
            sb.id, "/work/up", _tar([("old.txt", 4), ("new1", 40 * MiB), ("new2", 40 * MiB)])
        )
    assert "nothing it added was kept" in ei.value.message, ei.value.message
    r = await run(edge, sb.id, "ls -A /work/up")
    assert r.stdout.split() == ["old.txt"], r


async def test_write_edit_and_small_files_still_work(edge):
    sb = await edge.create(SandboxSpec(image="python", user="1000:1000"))
    await aw(edge.write_file(sb.id, "/work/d/e/f.txt", b"hello world", 0o600))
    r = await run(edge, sb.id, "stat -c '%a %u %g %s' /work/d/e/f.txt; cat /work/d/e/f.txt")
    assert r.stdout == "600 1000 1000 11\nhello world"
    assert await aw(edge.edit_file(sb.id, "/work/d/e/f.txt", "world", "there")) == 11
    assert await aw(edge.read_file(sb.id, "/work/d/e/f.txt")) == b"hello there"
    await aw(edge.write_file(sb.id, "/work/empty", b""))
    assert await aw(edge.read_file(sb.id, "/work/empty")) == b""


async def test_read_cap_holds_while_the_file_grows(edge):
    """The size check and the read are two steps: a file growing between them must not come
    back past the cap (before: 160 MiB past the 64 MiB cap)."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512))
    grower = (
        "f = open('/work/grow', 'wb', buffering=0)\n"
        "open('/work/started', 'w').close()\n"
        "while True:\n"
        "    f.truncate(0); f.seek(0); f.write(b'g' * (8 << 20))\n"
    )
    await aw(edge.write_file(sb.id, "/work/grower.py", grower.encode()))
    await run(edge, sb.id, "nohup python3 /work/grower.py >/dev/null 2>&1 &")
    while (await run(edge, sb.id, "test -e /work/started")).exit_code != 0:
        await asyncio.sleep(0.05)
    files = edge.sandboxes[sb.id].files
    cap = 1 * MiB
    longest = refused = 0
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and refused < 50:
        try:
            data = files.read("/work/grow", cap)
            longest = max(longest, len(data))
        except errors.PayloadTooLarge:
            refused += 1
    assert longest <= cap, f"a read returned {longest} bytes, past the {cap}-byte cap"
    assert refused > 0


async def test_archive_of_a_sparse_file_is_refused_without_buffering(edge):
    sb = await edge.create(SandboxSpec(image="python", memory_mb=256, disk_mb=64))
    await run(edge, sb.id, "mkdir -p /work/a && echo small > /work/a/ok && truncate -s 20G /work/a/sparse")
    t0 = time.monotonic()
    with pytest.raises(errors.PayloadTooLarge) as ei:
        await edge.download_tar(sb.id, "/work/a")
    assert time.monotonic() - t0 < 5
    assert "sparse" in ei.value.message and "/work/a" in ei.value.message
    # a normal archive still round-trips through the sandbox's own tar (a link out of it is
    # refused: tests/integration/test_download_attacks.py)
    await run(edge, sb.id, "rm /work/a/sparse && ln -s sub/../ok /work/a/link && mkdir /work/a/sub")
    data = await edge.download_tar(sb.id, "/work/a")
    await edge.upload_tar(sb.id, "/work/b", data)
    r = await run(edge, sb.id, "cat /work/b/ok; readlink /work/b/link; test -d /work/b/sub && echo dir")
    assert r.stdout == "small\nsub/../ok\ndir\n"
    single = await edge.download_tar(sb.id, "/work/a/ok")
    await edge.upload_tar(sb.id, "/work/c", single)
    assert await aw(edge.read_file(sb.id, "/work/c/ok")) == b"small\n"


async def test_archive_of_a_file_growing_under_it_stays_consistent(edge):
    """A file that grows while it is packed goes in at the size it had (the tar stays valid)."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512))
    await run(edge, sb.id, "mkdir /work/g && head -c 3000000 /dev/zero > /work/g/f")
    await run(
        edge,
        sb.id,
        "nohup sh -c 'while :; do head -c 1000000 /dev/zero >> /work/g/f; done' >/dev/null 2>&1 &",
    )
    for _ in range(5):
        data = await edge.download_tar(sb.id, "/work/g")
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            members = {m.name: m.size for m in tf.getmembers()}
            assert members["./f"] >= 3000000


async def test_a_directory_refilled_while_it_is_deleted_does_not_hold_the_delete(edge):
    """Processes inside keep creating files in the tree being deleted: the delete ends (done,
    or an error saying the directory is not empty) instead of chasing new entries forever."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=512))
    await run(edge, sb.id, "mkdir /work/churn && cd /work/churn && seq 20000 | xargs touch")
    await run(
        edge,
        sb.id,
        'for j in 1 2 3; do nohup python3 -c "import os, itertools\n'
        "for i in itertools.count():\n"
        "    try: open(f'/work/churn/n{os.getpid()}-{i}', 'w').close()\n"
        '    except OSError: pass" >/dev/null 2>&1 & done',
    )
    await asyncio.sleep(0.5)
    try:
        await asyncio.wait_for(aw(edge.delete_file(sb.id, "/work/churn", recursive=True)), 60)
    except errors.Conflict as e:  # new entries after the snapshot: rmdir finds it not empty
        assert "non-empty directory" in e.message, e.message
    await run(edge, sb.id, "pkill -9 -f itertools || true")


async def test_huge_listing_is_refused_off_the_event_loop(edge):
    """200,000 entries: the listing must neither stall the event loop nor come back whole."""
    sb = await edge.create(SandboxSpec(image="python", memory_mb=1024, disk_mb=1024))
    r = await run(
        edge,
        sb.id,
        "python3 -c \"import os; os.mkdir('/work/many'); [open(f'/work/many/f{i:06d}', 'w').close() for i in range(200000)]\"",  # noqa: E501
        timeout=300,
    )
    assert r.exit_code == 0, r.stderr
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        with pytest.raises(errors.PayloadTooLarge) as ei:
            await aw(edge.list_dir(sb.id, "/work/many"))
        # deleting the tree is long too: off the loop as well
        await aw(edge.delete_file(sb.id, "/work/many", recursive=True))
    finally:
        stop.set()
        await tick
    assert "subdirectory" in ei.value.message
    assert max(gaps) < 0.25, f"the event loop stalled for {max(gaps):.2f} s"
    assert (await run(edge, sb.id, "test -e /work/many || echo gone")).stdout == "gone\n"
    # a directory below the cap lists whole and sorted
    await run(edge, sb.id, "mkdir /work/few && touch /work/few/b /work/few/a")
    assert [e.name for e in await aw(edge.list_dir(sb.id, "/work/few"))] == ["a", "b"]


async def test_recursive_delete_never_crosses_a_mount(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    r = await run(
        edge, sb.id, "echo keep > /dev/shm/keep && mkdir -p /dev/shm/d && echo k > /dev/shm/d/k && echo ok"
    )
    assert r.stdout == "ok\n", r
    for target in ("/dev", "/dev/shm", "/proc", "/sys", "/dev/shm/d"):
        with pytest.raises(errors.DsecError) as ei:
            await aw(edge.delete_file(sb.id, target, recursive=True))
        assert 400 <= ei.value.status < 500, (target, ei.value)
    r = await run(edge, sb.id, "cat /dev/shm/keep /dev/shm/d/k; test -e /proc/self && echo proc")
    assert r.stdout == "keep\nk\nproc\n", r
    # a plain tree beside the mounts goes
    await run(
        edge, sb.id, "mkdir -p /work/t/u/v && touch /work/t/u/v/w /work/t/x && ln -s /dev/shm /work/t/l"
    )
    await aw(edge.delete_file(sb.id, "/work/t", recursive=True))
    r = await run(edge, sb.id, "test -e /work/t || echo gone; cat /dev/shm/keep")
    assert r.stdout == "gone\nkeep\n"


async def test_fifos_and_sockets_are_refused_by_type_without_blocking(edge):
    sb = await edge.create(SandboxSpec(image="python"))
    sock = "import socket, time; s = socket.socket(socket.AF_UNIX); s.bind('/work/sock'); s.listen(); time.sleep(60)"  # noqa: E501
    await run(
        edge,
        sb.id,
        ["sh", "-c", f'mkfifo /work/fifo /work/fifo2; nohup python3 -c "{sock}" >/dev/null 2>&1 &'],
    )
    while (await run(edge, sb.id, "test -S /work/sock")).exit_code != 0:
        await asyncio.sleep(0.05)
    # a reader holds fifo2 open: an open for writing would succeed, the type check must refuse
    await run(edge, sb.id, "nohup sh -c 'exec 3</work/fifo2; sleep 60' >/dev/null 2>&1 &")
    await asyncio.sleep(0.2)
    cases = [
        ("read", "/work/sock", "socket"),
        ("read", "/work/fifo", "FIFO"),
        ("write", "/work/fifo", "FIFO"),
        ("write", "/work/sock", "socket"),
        ("write", "/work/fifo2", "FIFO"),
        ("read", "/work/fifo2", "FIFO"),
        ("edit", "/work/fifo", "FIFO"),
        ("read", "/dev/null", "mount"),
    ]
    for op, path, word in cases:
        t0 = time.monotonic()
        with pytest.raises(errors.DsecError) as ei:
            if op == "read":
                await asyncio.wait_for(aw(edge.read_file(sb.id, path)), 5)
            elif op == "write":
                await asyncio.wait_for(aw(edge.write_file(sb.id, path, b"x")), 5)
            else:
                await asyncio.wait_for(aw(edge.edit_file(sb.id, path, "a", "b")), 5)
        assert 400 <= ei.value.status < 500, (op, path, ei.value)
        assert word in ei.value.message, (op, path, ei.value.message)
        assert time.monotonic() - t0 < 2


async def test_idle_reaper_leaves_a_busy_sandbox_alone(edge):
    """ttl_idle_s passes while an exec (or a file op, or a stream) still runs: not idle.
    One sandbox per ttl_action, side by side on the same timeline (each reap_idle() call
    sees both)."""
    sbs = [
        await edge.create(SandboxSpec(image="python", ttl_idle_s=1, ttl_action=action))
        for action in ("stop", "pause")
    ]
    tasks = [asyncio.create_task(run(edge, sb.id, "sleep 3; echo done")) for sb in sbs]
    await asyncio.sleep(2)
    assert await edge.reap_idle() == []
    for task in tasks:
        r = await task
        assert (r.stdout, r.exit_code) == ("done\n", 0)
    # the end of the exec counts as activity: not reaped the moment it returns
    assert await edge.reap_idle() == []
    for sb in sbs:
        assert edge.get(sb.id).state.value == "running"
    await asyncio.sleep(1.2)
    assert sorted(await edge.reap_idle()) == sorted(sb.id for sb in sbs)


async def test_reaper_skips_a_sandbox_with_a_file_operation_in_flight(edge):
    sb = await edge.create(SandboxSpec(image="python", ttl_idle_s=1, memory_mb=512))
    await asyncio.sleep(1.2)
    data = b"q" * (200 * MiB)
    write = asyncio.create_task(aw(edge.write_file(sb.id, "/work/big", data)))
    await asyncio.sleep(0.005)  # the write is under way (its copier is copying)
    assert not write.done()
    edge.sandboxes[sb.id].record.last_active -= 10  # as if the write began long ago
    assert await edge.reap_idle() == []
    await write
    assert (await run(edge, sb.id, "stat -c %s /work/big")).stdout.strip() == str(len(data))
