"""The microVM guest, for real: Debian's kernel under QEMU's microvm machine (TCG here), the
dsec-guest agent as init, the image's layers as EROFS disks under an overlay with a writable
ext4 disk, the shim protocol framed on the virtio-serial port (GuestChannel), and a template
memory image restored into new VMs.

These are the pieces the microvm backend is built from (issue #13); the backend itself is
not registered yet."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dsec.backends import qemu
from dsec.backends.guestchannel import GuestChannel
from dsec.backends.shim import Launch
from dsec.native import ensure_shim, ensure_tool

pytestmark = pytest.mark.root

DATA = Path("/var/lib/dsec")
CACHE = DATA / "microvm" / "cache"
PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


@pytest.fixture(scope="module")
def image(python_image: str, tmp_path_factory: pytest.TempPathFactory) -> qemu.GuestImage:
    from dsec.layers import LayerStore
    from tests.conftest import LAYERS

    try:
        binary = qemu.find_qemu()
        vmlinuz, modules = qemu.guest_kernel(DATA)
    except qemu.QemuUnavailable as e:
        if os.environ.get("DSEC_TEST_SKIP_ABSENT_BACKENDS") == "1":
            pytest.skip(str(e))
        raise
    bin_dir = tmp_path_factory.mktemp("guest-bin")
    agent = ensure_tool("dsec-guest", bin_dir)
    shim = ensure_shim(bin_dir)
    store = LayerStore(LAYERS)
    idmap = [str(shim), "idmap-run", f"{100000}:0:65536"]
    layers = [qemu.layer_image(CACHE, p, idmap) for p in store.lowerdirs(store.get_image(python_image))]
    return qemu.GuestImage(binary, vmlinuz, qemu.build_initramfs(CACHE, agent, modules), layers)


@contextlib.asynccontextmanager
async def vm(image: qemu.GuestImage, d: Path, *, incoming: bool = False) -> AsyncIterator[qemu.GuestVm]:
    d.mkdir(parents=True, exist_ok=True)
    disk = d / "rw.ext4"
    qemu.sparse_copy(qemu.blank_disk(CACHE, 512, 32768), disk)
    v = await qemu.start_vm(image, d, disk, incoming=incoming)
    try:
        yield v
    finally:
        await v.kill()
        assert not Path(f"/proc/{v.pid}").exists()  # killed and reaped: no QEMU left


async def run(
    channel: GuestChannel, cmd: str, stdin: bytes | None = None, uid: int = 0
) -> tuple[str, str, int]:
    """One process in the guest through the channel: its output and exit status."""
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    launch = Launch(["/bin/sh", "-c", cmd], {"PATH": PATH}, "/", uid, uid)
    try:
        _, _, exited = await channel.spawn(launch, stdio=(in_r, out_w, err_w))
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    loop = asyncio.get_running_loop()

    def feed() -> None:
        with open(in_w, "wb") as f:
            f.write(stdin or b"")

    def drain(fd: int) -> bytes:
        with open(fd, "rb") as f:
            return f.read()

    got = await asyncio.gather(
        loop.run_in_executor(None, feed),
        loop.run_in_executor(None, drain, out_r),
        loop.run_in_executor(None, drain, err_r),
        asyncio.wait_for(exited, 120),
    )
    status = got[3]
    code = os.waitstatus_to_exitcode(status)
    return got[1].decode(), got[2].decode(), code


async def start(v: qemu.GuestVm, hostname: str = "guest") -> None:
    await asyncio.wait_for(v.channel.hello, 60)
    await v.channel.setup(qemu.setup_body(nlower=v.nlower, pids=256, hostname=hostname))


async def test_guest_boots_runs_and_confines(image: qemu.GuestImage, tmp_path: Path) -> None:
    async with vm(image, tmp_path / "cold") as v:
        await start(v, "sb-cold")
        out, err, code = await run(v.channel, "id -u; hostname; cat /proc/version; echo oops >&2; exit 3")
        assert code == 3 and err == "oops\n"
        uid, host, version = out.splitlines()[:3]
        assert uid == "0" and host == "sb-cold"
        assert "Linux version 6.1" in version and os.uname().release not in version  # its own kernel
        # the image's files, owned by the guest's own ids (the store's range mapped down)
        out, _, code = await run(
            v.channel, "stat -c '%u %g' /usr/bin/python3.11 /etc/passwd; python3 -c 'print(6*7)'"
        )
        assert code == 0 and out.split("\n")[:3] == ["0 0", "0 0", "42"]
        # stdin through the port, and a large output back (more than a pipe holds)
        data = os.urandom(300_000).hex().encode()
        out, _, code = await run(v.channel, "sha256sum; head -c 1000000 /dev/zero | tr '\\0' x", stdin=data)
        assert code == 0 and out.startswith(hashlib.sha256(data).hexdigest())
        assert out.count("x") == 1_000_000
        # writes land on the writable disk, over the layers
        out, _, code = await run(v.channel, "echo hi > /etc/motd && cat /etc/motd && df -P / | tail -1")
        assert code == 0 and out.startswith("hi\n")


async def test_guest_processes_lack_what_would_reach_the_agent(
    image: qemu.GuestImage, tmp_path: Path
) -> None:
    async with vm(image, tmp_path / "conf") as v:
        await start(v)
        probes = {
            "caps": "grep CapEff /proc/self/status",
            "devices": "ls /dev",
            "agent_fds": "ls /proc/1/fd 2>&1; cat /proc/1/environ 2>&1 | head -c 50",
            "mount": "mount -t tmpfs x /mnt 2>&1; echo rc=$?",
            "mknod": "mknod /tmp/vport c 250 1 2>&1; echo rc=$?",
            "module": "echo > /tmp/x.ko; insmod /tmp/x.ko 2>&1 | head -1; echo done",
            "cgroup": "cat /proc/mounts | grep -c cgroup; ls /sys/fs/cgroup 2>&1 | head -3",
            "chroot": "chroot / true 2>&1; echo rc=$?",
        }
        got = {k: (await run(v.channel, c))[0] for k, c in probes.items()}
        assert got["caps"].split()[1] == "00000000000004fb"  # the container backend's set
        assert set(got["devices"].split()) <= {
            "null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "ptmx",
            "fd", "stdin", "stdout", "stderr",
        }  # fmt: skip
        assert "Permission denied" in got["agent_fds"]
        assert "rc=0" not in got["mount"] and "rc=0" not in got["mknod"] and "rc=0" not in got["chroot"]
        assert got["cgroup"].split("\n")[0] == "0"  # no cgroup file system anywhere inside


async def test_a_kill_reaches_what_left_the_session(image: qemu.GuestImage, tmp_path: Path) -> None:
    """SIGKILL of an exec kills its guest cgroup: a setsid child goes too."""
    async with vm(image, tmp_path / "kill") as v:
        await start(v)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        launch = Launch(["/bin/sh", "-c", "setsid sleep 1000 & sleep 1000"], {"PATH": PATH}, "/", 0, 0)
        ident, _, exited = await v.channel.spawn(launch, stdio=(devnull, out_w, out_w))
        os.close(out_w)
        os.close(devnull)
        await asyncio.sleep(1.0)
        v.channel.signal(ident, signal.SIGKILL)
        status = await asyncio.wait_for(exited, 30)
        os.close(out_r)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        out, _, _ = await run(v.channel, "for p in /proc/[0-9]*; do cat $p/comm; done | grep -c sleep")
        assert out.strip() == "0"


async def test_clones_of_a_template_are_fresh(image: qemu.GuestImage, tmp_path: Path) -> None:
    """A template booted to the agent's hello and saved; each clone restored from it gets
    its own entropy and clock, its own writable disk, and runs."""
    state = tmp_path / "template.state"
    async with vm(image, tmp_path / "template") as t:
        await asyncio.wait_for(t.channel.hello, 60)
        with open(state, "wb") as f:
            await t.qmp.save(f.fileno())
    seen = []
    for k in range(2):
        t0 = time.monotonic()
        async with vm(image, tmp_path / f"clone{k}", incoming=True) as c:
            with open(state, "rb") as f:
                await c.qmp.restore(f.fileno())
            await c.channel.setup(qemu.setup_body(nlower=len(image.layers), pids=256, hostname=f"c{k}"))
            out, _, code = await run(c.channel, "hostname; head -c 16 /dev/urandom | od -An -tx1; date +%s")
            assert code == 0, out
            host, rnd, clock = out.split("\n")[0], out.split("\n")[1], int(out.split()[-1])
            assert host == f"c{k}" and abs(clock - time.time()) < 30
            seen.append(rnd)
            print(f"clone {k}: restore -> first exec {time.monotonic() - t0:.2f} s")
    assert seen[0] != seen[1]
