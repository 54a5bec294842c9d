"""What the microVM backend runs on: QEMU, a guest kernel from Debian, the guest's initramfs,
the image's layers as EROFS disks, and whether KVM really works here.

* QEMU is Debian's qemu-system-x86 (install.sh installs it), its `microvm` machine: no PCI,
  no firmware, virtio-mmio devices found through ACPI.
* The guest kernel is Debian's linux-image-cloud-amd64 (virtio, EROFS, overlayfs as modules),
  unpacked under the data directory with the private apt state of `dsec.backends.debian`
  (nothing is installed on the host, /boot is untouched).
* The initramfs holds only `dsec-guest` (the agent, built from dsec-guest.c) as /init and
  the few modules it loads, in dependency order.
* Layers: the layer store keeps each tree owned by its canonical id range; its EROFS image
  is made by mkfs.erofs over an idmapped read-only view of the tree showing those owners as
  the guest's own ids (0..), cached beside the store by the layer's path and mtime.
* KVM: /dev/kvm can exist and still not boot a stock guest (PVM-backed here: this guest
  gives no sign of life under KVM within 20 s, Dec 2026). `vm_argv(kvm=...)` differs only
  in the accelerator; the probe that picks it belongs to the backend (not built yet).
* A VM restored from a saved state (a template's clone) is given only the kernel's header
  (`kernel_header`): QEMU keeps the -kernel image it read in its own memory for the VM's
  life (fw_cfg's copy for the boot ROM, 13.5 MiB of anonymous memory per QEMU here), which
  a guest whose RAM is restored never reads; the initramfs is mapped from its file, shared.
* A VM: `vm_argv` (the same machine for a template and its clones), `Qmp` (save a booted
  template's state to a descriptor, restore it into a new VM), `setup_body` (the agent's
  per-sandbox setup: fresh entropy, clock, layers, limits, name).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.aio import wait_for
from dsec.backends.debian import FetchError, fetch_tree
from dsec.backends.guestchannel import GuestChannel
from dsec.backends.writable import mkfs_once
from dsec.isolation.procs import spawn_quick, wait_quick

KERNEL_PACKAGE = "linux-image-cloud-amd64"
KERNEL_SUITE = "bookworm"
# what the agent needs, in the order it loads them (dependencies first)
GUEST_MODULES = (
    "virtio",
    "virtio_ring",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "failover",
    "net_failover",
    "virtio_net",
    "libcrc32c",
    "erofs",
    "overlay",
    "virtio-rng",
)


class QemuUnavailable(RuntimeError):
    pass


def find_qemu() -> Path:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        raise QemuUnavailable("qemu-system-x86_64 is not installed (install.sh installs qemu-system-x86)")
    for tool in ("mkfs.erofs", "mkfs.ext4"):
        if shutil.which(tool) is None:
            raise QemuUnavailable(f"{tool} is not installed (install.sh installs erofs-utils and e2fsprogs)")
    return Path(path)


def kernel_dir(data_dir: Path) -> Path:
    return data_dir / "microvm" / "kernel"


def guest_kernel(data_dir: Path) -> tuple[Path, Path]:
    """(vmlinuz, the modules directory) of the guest kernel unpacked under `data_dir`."""
    root = kernel_dir(data_dir)
    if not (root / ".ready").exists():
        raise QemuUnavailable(f"no guest kernel under {root}: run the install script")
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise QemuUnavailable(f"no vmlinuz in {root}/boot")
    vmlinuz = kernels[-1]
    release = vmlinuz.name.removeprefix("vmlinuz-")
    return vmlinuz, root / "lib" / "modules" / release


def ensure_guest_kernel(data_dir: Path) -> Path:
    """Fetch and unpack Debian's cloud kernel once; the vmlinuz path."""
    root = kernel_dir(data_dir)
    if not (root / ".ready").exists():

        def check(tree: Path, _work: Path) -> str:
            kernels = sorted((tree / "boot").glob("vmlinuz-*"))
            if not kernels:
                raise FetchError(f"{KERNEL_PACKAGE} has no vmlinuz")
            return kernels[-1].name + "\n"

        fetch_tree(root, KERNEL_PACKAGE, suite=KERNEL_SUITE, only="linux-image", check=check)
    return guest_kernel(data_dir)[0]


# --- the initramfs ------------------------------------------------------------------------


def _cpio_entry(name: str, mode: int, data: bytes = b"", ino: int = 0) -> bytes:
    """One entry of a newc cpio archive (what the kernel unpacks as the initramfs)."""
    encoded = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
    head = b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + encoded
    head += b"\0" * (-len(head) % 4)
    return head + data + b"\0" * (-len(data) % 4)


def build_initramfs(dest: Path, agent: Path, modules_dir: Path) -> Path:
    """The guest's initramfs at `dest` (rebuilt only when the agent or the kernel change)."""
    key = hashlib.sha256(agent.read_bytes() + str(modules_dir).encode()).hexdigest()[:16]
    target = dest / f"initramfs-{key}.cpio"
    if target.exists():
        return target
    found = {p.name.removesuffix(".ko"): p for p in modules_dir.rglob("*.ko")}
    missing = [m for m in GUEST_MODULES if m not in found]
    if missing:
        raise QemuUnavailable(f"the guest kernel lacks modules: {', '.join(missing)}")
    parts = [
        _cpio_entry("dev", 0o40755, ino=1),
        _cpio_entry("modules", 0o40700, ino=2),
        _cpio_entry("init", 0o100755, agent.read_bytes(), ino=3),
    ]
    for i, name in enumerate(GUEST_MODULES):
        parts.append(_cpio_entry(f"modules/{i:02d}-{name}.ko", 0o100600, found[name].read_bytes(), 10 + i))
    parts.append(_cpio_entry("TRAILER!!!", 0))
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{target.name}.{os.getpid()}"
    tmp.write_bytes(b"".join(parts))
    os.replace(tmp, target)
    return target


def kernel_header(dest: Path, vmlinuz: Path) -> Path:
    """The bzImage `vmlinuz` cut after its real-mode setup sectors, at `dest` (made once per
    kernel): what a VM restored from a saved state is started with. QEMU parses the header
    as for a boot (the same machine: the same option ROM, the same fw_cfg entries) but holds
    a kernel of 0 bytes instead of the whole image; the restored guest never reads it (and a
    reset ends QEMU: -no-reboot). A kernel that is not a bzImage is returned as it is."""
    st = vmlinuz.stat()
    target = dest / f"{vmlinuz.name}.header-{st.st_size}-{st.st_mtime_ns}"
    if target.exists():
        return target
    with open(vmlinuz, "rb") as f:
        head = f.read(0x1000)
        if len(head) < 0x210 or head[0x202:0x206] != b"HdrS":
            return vmlinuz
        size = ((head[0x1F1] or 4) + 1) * 512
        f.seek(0)
        data = f.read(size)
    if len(data) != size:
        return vmlinuz
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / f".{target.name}.{os.getpid()}"
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, target)
    return target


# --- disks --------------------------------------------------------------------------------


def layer_image(cache: Path, layer: Path, idmap_run: list[str], timeout: float = 600.0) -> Path:
    """The EROFS image of layer directory `layer` (made once; layers do not change).

    `idmap_run` is the command prefix that runs a command with the tree visible at a path
    through the idmap (dsec-shim idmap-run FROM:TO:COUNT SRC MOUNTPOINT --)."""
    st = layer.stat()
    key = hashlib.sha256(f"{layer.resolve()}:{st.st_ino}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
    target = cache / f"{key}.erofs"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".erofs-", dir=cache) as tmp:
        view = Path(tmp) / "view"
        view.mkdir()
        out = Path(tmp) / "image.erofs"
        argv = [
            *idmap_run,
            str(layer),
            str(view),
            "--",
            "mkfs.erofs",
            "-E",
            "noinline_data",
            str(out),
            str(view),
        ]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"mkfs.erofs of layer {layer} failed: {(r.stderr or r.stdout)[-800:]}")
        os.chmod(out, 0o644)
        os.replace(out, target)
    return target


def blank_disk(cache: Path, size_mb: int, inodes: int) -> Path:
    """An empty ext4 file system of `size_mb`, its root owned by the guest's root, made once
    per size: each sandbox's writable disk starts as a sparse copy of it."""
    options = ["-N", str(inodes), "-E", "root_owner=0:0,lazy_itable_init=0,nodiscard", "-O", "^has_journal",
               "-L", "dsec-rw"]  # fmt: skip
    return mkfs_once(cache / f"blank-{size_mb}m-{inodes}i.ext4", size_mb, options)


def sparse_copy(src: Path, dst: Path) -> None:
    """Copy a disk image keeping its holes (a fresh writable disk costs only what mkfs wrote)."""
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", str(src), str(dst)], check=True, timeout=120)


# --- one VM -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Disk:
    path: Path
    serial: str  # how the guest finds it: "l0".. the layers, "rw" the writable disk
    readonly: bool


def vm_argv(
    qemu: Path,
    *,
    vmlinuz: Path,
    initrd: Path,
    disks: Sequence[Disk],
    ctl: Path | int,
    qmp: Path | int,
    memory_mb: int,
    cpus: int,
    kvm: bool,
    console: Path,
    incoming: bool = False,
    tap_fd: int | None = None,
    ram: tuple[Path | None, bool] | None = None,
) -> list[str]:
    """The command line of a guest: the same for a template and every clone of it (a
    migration restores only into the same machine), apart from the disk files, the sockets
    and `incoming`."""
    # Under TCG the kernel's TSC calibration against the emulated PIT fails now and then
    # (then it hangs without a clock source): give it the rate instead. The console is a host
    # file: only critical messages go there (loglevel=3), or a guest could grow it with every
    # message it can make its kernel print (an OOM kill's line is an error).
    append = "console=ttyS0 quiet loglevel=3 panic=-1" + ("" if kvm else " tsc_early_khz=2000000")
    argv = [
        str(qemu),
        "-M", "microvm,isa-serial=on",
        "-accel", "kvm" if kvm else "tcg,tb-size=32",
        "-cpu", "host" if kvm else "max",
        "-m", f"{memory_mb}M",
        "-smp", str(cpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(vmlinuz),
        "-initrd", str(initrd),
        "-append", append,
        "-chardev", f"socket,id=ctl,{_listen(ctl)},server=on,wait=off",
        "-chardev", f"socket,id=qmp,{_listen(qmp)},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        "-device", "virtio-serial-device",
        "-device", "virtserialport,chardev=ctl,name=dsec",
        "-device", "virtio-rng-device",
        "-serial", f"file:{console}",
        # QEMU's own system calls: no new processes, no privileges, nothing obsolete
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]  # fmt: skip
    for i, d in enumerate(disks):
        # (the writable disk bypasses the host's page cache: its dirty pages would be charged to
        # QEMU's memory cgroup, which a v1 hierarchy does not throttle: a guest writing past its
        # memory_mb got QEMU OOM-killed; the layers' images stay cached, shared by every guest)
        ro = ",readonly=on" if d.readonly else ",cache=none"
        argv += ["-drive", f"id=d{i},file={d.path},format=raw,if=none{ro}"]
        argv += ["-device", f"virtio-blk-device,drive=d{i},serial={d.serial}"]
    if ram is not None:  # guest RAM in a file: (path, shared) (see Template); no path: anonymous
        path, shared = ram
        backend = (
            f"memory-backend-file,id=ram,size={memory_mb}M,mem-path={path},share={_on(shared)}"
            if path is not None
            else f"memory-backend-ram,id=ram,size={memory_mb}M"  # (the same RAM block as a clone's)
        )
        argv += ["-object", backend, "-machine", "memory-backend=ram"]
    if tap_fd is not None:  # the tap in QEMU's own network namespace (see start_vm)
        argv += ["-netdev", f"tap,id=n0,fd={tap_fd}"]
        argv += ["-device", "virtio-net-device,netdev=n0,mac=52:54:00:d5:ec:01"]
    if incoming:
        argv += ["-incoming", "defer"]
    return argv


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _listen(where: Path | int) -> str:
    """A chardev's listening socket: a path QEMU binds, or one the caller bound (an fd)."""
    return f"fd={where}" if isinstance(where, int) else f"path={where}"


class Qmp:
    """QEMU's machine protocol on its unix socket (one command at a time)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock: socket.socket
    ) -> None:
        self.reader, self.writer, self.sock = reader, writer, sock

    @classmethod
    async def connect(cls, path: Path, timeout: float = 10.0) -> Qmp:
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                sock.connect(str(path))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.002)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        q = cls(reader, writer, sock)
        try:
            await wait_for(reader.readline(), timeout)  # the greeting
            await q.cmd("qmp_capabilities")
        except BaseException:  # QEMU died, or the create was cancelled (an edge closing)
            q.close()
            raise
        return q

    async def cmd(self, name: str, args: dict[str, Any] | None = None, fd: int | None = None) -> Any:
        msg = json.dumps({"execute": name, **({"arguments": args} if args else {})}).encode()
        if fd is None:
            self.writer.write(msg)
            await self.writer.drain()
        else:
            await self.writer.drain()
            socket.send_fds(self.sock, [msg], [fd])  # a short message on an idle socket
        while True:
            line = await self.reader.readline()
            if not line:
                raise RuntimeError(f"QEMU closed its QMP socket during {name}")
            reply = json.loads(line)
            if "event" in reply:
                continue
            if "error" in reply:
                raise RuntimeError(f"QMP {name}: {reply['error'].get('desc')}")
            return reply.get("return")

    async def wait_status(self, leave: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while (status := (await self.cmd("query-status"))["status"]) == leave:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the VM stayed {leave}")
            await asyncio.sleep(0.002)
        return str(status)

    async def ignore_shared(self) -> None:
        """Leave RAM in a file out of the migration stream (both sides: see Template)."""
        caps = [{"capability": "x-ignore-shared", "state": True}]
        await self.cmd("migrate-set-capabilities", {"capabilities": caps})

    async def save(self, fd: int, timeout: float = 60.0) -> None:
        """Stop the VM and write its state to `fd` (a migration)."""
        await self.cmd("stop")
        await self.cmd("getfd", {"fdname": "save"}, fd=fd)
        await self.cmd("migrate", {"uri": "fd:save"})
        deadline = time.monotonic() + timeout
        while (st := (await self.cmd("query-migrate")).get("status")) not in ("completed", "failed"):
            if time.monotonic() > deadline:
                raise TimeoutError("the VM's state was not written in time")
            await asyncio.sleep(0.005)
        if st != "completed":
            raise RuntimeError("QEMU failed to write the VM's state")

    async def restore(self, fd: int) -> None:
        """Load a state written by `save` into this VM (started with `incoming`) and run it."""
        await self.cmd("getfd", {"fdname": "load"}, fd=fd)
        await self.cmd("migrate-incoming", {"uri": "fd:load"})
        await self.wait_status("inmigrate")
        await self.cmd("cont")

    def close(self) -> None:
        self.writer.close()


def setup_body(
    *,
    nlower: int,
    pids: int,
    hostname: str,
    address: str = "",
    gateway: str = "",
    seccomp: bytes = b"",
    masked: Sequence[str] = (),
    readonly: Sequence[str] = (),
    memory_mb: int = 0,
) -> bytes:
    """The agent's 'M' frame: fresh entropy (a template's clones share its random state),
    the clock, the layers, the process limit, the name and the network; then what every
    process gets (the seccomp program, a `struct sock_filter` array) and the kernel paths
    masked and made read-only, as in a container (dsec.isolation.spec), and the memory of
    all its processes together (0: the VM's)."""
    seed = os.urandom(64)
    now = time.time_ns()
    body = struct.pack("<I", len(seed)) + seed + struct.pack("<qq", now // 10**9, now % 10**9)
    body += bytes([nlower]) + struct.pack("<I", pids)
    body += b"".join(s.encode() + b"\0" for s in (hostname, address, gateway))
    body += struct.pack("<I", len(seccomp)) + seccomp
    for paths in (masked, readonly):
        body += struct.pack("<H", len(paths)) + b"".join(p.encode() + b"\0" for p in paths)
    return body + struct.pack("<Q", memory_mb << 20)


def resumed_body(hostname: str) -> bytes:
    """The agent's 'Z' frame, for a VM restored from a memory checkpoint: fresh entropy
    (every restore of one checkpoint would share its random state), the clock, its name."""
    seed = os.urandom(64)
    now = time.time_ns()
    body = struct.pack("<I", len(seed)) + seed + struct.pack("<qq", now // 10**9, now % 10**9)
    return body + hostname.encode() + b"\0"


@dataclass(frozen=True)
class GuestImage:
    """What every VM of one image boots: QEMU, the kernel, the initramfs, the layer disks;
    `restore_kernel`: what a VM restored from a saved state is given instead of the kernel
    (`kernel_header`; None: the kernel)."""

    qemu: Path
    vmlinuz: Path
    initrd: Path
    layers: Sequence[Path]
    restore_kernel: Path | None = None


@dataclass
class GuestVm:
    """One running QEMU and the edge's ends of its port and its monitor."""

    pid: int
    pidfd: int
    channel: GuestChannel
    qmp: Qmp
    dir: Path
    nlower: int

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        await wait_quick(self.pid, self.pidfd)
        self.channel.close()
        self.qmp.close()


# QEMU of a sandbox runs in a network namespace of its own holding one tap ("tap0", the
# guest's eth0; nothing beyond it until the edge links the namespace to its gateway), as the
# sandbox's own unprivileged host uid, with no capabilities and no new privileges, under
# QEMU's own seccomp filter (`dsec-shim vm-launch` does all but the filter). It opens no host
# path: the kernel, the initramfs, the disks, the console, the tap and both sockets come as
# descriptors.


def _listener(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        sock.listen(4)
    except BaseException:
        sock.close()
        raise
    return sock


async def start_vm(
    image: GuestImage,
    d: Path,
    disk: Path,
    *,
    memory_mb: int = 256,
    cpus: int = 1,
    kvm: bool = False,
    incoming: bool = False,
    confine: tuple[Path, int] | None = None,
    place: Callable[[int], None] | None = None,
    ram: tuple[int, bool] | None = None,
    anonymous_ram: bool = False,
) -> GuestVm:
    """Start QEMU for a VM in directory `d` with writable disk `disk` (`incoming`: waiting
    for a saved state, see Qmp.restore) and connect to it. `confine`: (dsec-shim, host uid):
    confined as that uid in a network namespace of its own with a tap; `place`: called with
    QEMU's pid at once (to put it into the sandbox's host cgroups); `ram`: (a memfd, shared):
    the guest's RAM in it, written through (a template) or mapped copy-on-write (a clone);
    `anonymous_ram`: the same RAM block as a clone's, in QEMU's own memory (a VM restored
    from a memory checkpoint, whose RAM all comes from the checkpoint)."""
    held: list[int] = []

    def fd_path(path: Path, flags: int = os.O_RDONLY) -> Path:
        held.append(os.open(path, flags | os.O_CLOEXEC))
        return Path(f"/proc/self/fd/{held[-1]}")

    console = d / "console.log"
    console.touch(mode=0o600)
    if confine is not None:  # QEMU reopens these through /proc/self/fd: its own uid must own them
        for owned in (console, disk):
            os.chown(owned, confine[1], confine[1])
    socks = [_listener(d / "ctl.sock"), _listener(d / "qmp.sock")]
    pid = pidfd = -1
    try:
        disks = [Disk(fd_path(p), f"l{i}", True) for i, p in enumerate(image.layers)]
        disks.append(Disk(fd_path(disk, os.O_RDWR), "rw", False))
        kernel = image.restore_kernel if incoming and image.restore_kernel is not None else image.vmlinuz
        boot = fd_path(kernel), fd_path(image.initrd), fd_path(console, os.O_WRONLY)
        ram_file: tuple[Path | None, bool] | None = (None, False) if anonymous_ram else None
        if ram is not None:  # a copy of the descriptor: QEMU reopens it through /proc/self/fd
            held.append(os.dup(ram[0]))
            ram_file = (Path(f"/proc/self/fd/{held[-1]}"), ram[1])
        inherit = [*held, *(s.fileno() for s in socks)]
        tap_fd = max(inherit) + 1 if confine is not None else None  # free in the launcher
        argv = vm_argv(
            image.qemu, vmlinuz=boot[0], initrd=boot[1], disks=disks, ctl=socks[0].fileno(),
            qmp=socks[1].fileno(), memory_mb=memory_mb, cpus=cpus, kvm=kvm, console=boot[2],
            incoming=incoming, tap_fd=tap_fd, ram=ram_file,
        )  # fmt: skip
        if confine is not None:
            group = str(kvm_group()) if kvm else "-"
            argv = [str(confine[0]), "vm-launch", str(confine[1]), str(tap_fd), group, "--", *argv]
        with open(d / "qemu.log", "wb") as log:
            pid, pidfd = spawn_quick(argv, log.fileno(), log.fileno(), inherit=inherit)
        if place is not None:
            place(pid)
    except BaseException:
        if pid > 0:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            await wait_quick(pid, pidfd)
        raise
    finally:
        for s in socks:
            s.close()
        for fd in held:
            os.close(fd)
    try:
        return await connect_vm(d, pid, pidfd, len(image.layers))
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await wait_quick(pid, pidfd)
        raise


async def connect_vm(d: Path, pid: int, pidfd: int, nlower: int, timeout: float = 20.0) -> GuestVm:
    """The edge's ends of a running QEMU's monitor and port (also after an edge restart)."""
    try:
        q = await Qmp.connect(d / "qmp.sock", timeout)
    except (OSError, RuntimeError, TimeoutError) as e:
        log = (d / "qemu.log").read_text(errors="replace").strip()[-800:]
        raise QemuUnavailable(f"QEMU did not answer: {log or e}") from e
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(str(d / "ctl.sock"))  # QMP answered: the port's chardev listens already
    except BaseException:
        sock.close()
        q.close()
        raise
    return GuestVm(pid, pidfd, GuestChannel(sock), q, d, nlower)


def time_to_hello(image: GuestImage, *, kvm: bool, timeout: float) -> float | None:
    """Seconds from starting QEMU to the agent's hello, with no disks (the boot floor of a
    guest: kernel, initramfs, modules, the port); None if it did not come within `timeout`."""
    with tempfile.TemporaryDirectory(prefix="dsec-boot-") as tmp:
        d = Path(tmp)
        socks = [_listener(d / "ctl.sock"), _listener(d / "qmp.sock")]
        argv = vm_argv(
            image.qemu, vmlinuz=image.vmlinuz, initrd=image.initrd, disks=[], ctl=socks[0].fileno(),
            qmp=socks[1].fileno(), memory_mb=128, cpus=1, kvm=kvm, console=d / "console.log",
        )  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=[s.fileno() for s in socks],
        )  # fmt: skip
        for s in socks:
            s.close()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as c:
                c.settimeout(timeout)
                c.connect(str(d / "ctl.sock"))
                if c.recv(1) == b"H":
                    return time.perf_counter() - t0
        except OSError:
            pass
        finally:
            proc.kill()
            proc.wait()
    return None


def kvm_group() -> int | None:
    """The group that may open /dev/kvm read-write, which a confined QEMU (the sandbox's own
    unprivileged uid) is given; None if only root may (then KVM is not for sandboxes)."""
    try:
        st = os.stat("/dev/kvm")
    except OSError:
        return None
    return st.st_gid if st.st_gid != 0 and st.st_mode & 0o060 == 0o060 else None


def probe_kvm(image: GuestImage, state: Path, timeout: float = 10.0) -> tuple[bool, str]:
    """Whether a guest really boots under KVM here (to the agent's hello within `timeout`),
    and why not; probed once per host boot, kernel and initramfs (cached in `state`). A
    /dev/kvm that exists may still not run a stock guest (PVM-backed hosts: the guest hangs),
    and one only root may open cannot serve confined QEMUs."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "no usable /dev/kvm"
    if kvm_group() is None:
        return (
            False,
            "/dev/kvm is root's only (QEMU runs as the sandbox's own uid: give it a group, e.g. kvm, 0660)",
        )
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    key = {"boot": boot_id, "kernel": image.vmlinuz.name, "initrd": image.initrd.name}
    cache = state / "kvm.json"
    with contextlib.suppress(OSError, ValueError, KeyError):
        cached = json.loads(cache.read_text())
        if cached["key"] == key:
            return bool(cached["works"]), str(cached["why"])
    state.mkdir(parents=True, exist_ok=True)
    works = time_to_hello(image, kvm=True, timeout=timeout) is not None
    why = "" if works else f"a guest did not boot under KVM within {timeout:.0f} s"
    with contextlib.suppress(OSError):
        tmp_cache = cache.with_suffix(f".{os.getpid()}")
        tmp_cache.write_text(json.dumps({"key": key, "works": works, "why": why}))
        tmp_cache.replace(cache)
    return works, why
