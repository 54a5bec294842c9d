"""Adversarial isolation tests: everything here runs as root INSIDE a real sandbox and tries to get out.

Each test creates its sandboxes through the `edge` fixture (stopped at teardown) and
proves a boundary from inside with `exec`, or attacks the host-side file API with
paths and symlinks a hostile sandbox could plant.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import os
import re
import secrets
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec import errors
from dsec.backends.base import Capability
from dsec.isolation.spec import CAPABILITIES
from dsec.models import ExecRequest, SandboxSpec
from tests.conftest import require

pytestmark = [pytest.mark.root, pytest.mark.asyncio]

CAP_BITS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_ADMIN": 12,
    "CAP_NET_RAW": 13,
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_RAWIO": 17,
    "CAP_SYS_CHROOT": 18,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_SYS_BOOT": 22,
    "CAP_MKNOD": 27,
}


async def run(edge, sid, cmd, **kw):
    return await edge.exec(sid, ExecRequest(cmd=cmd, **kw))


async def py(edge, sid, src: str, **kw):
    """Run Python source inside the sandbox (fed on stdin, so no quoting games)."""
    return await edge.exec(sid, ExecRequest(cmd=["python3", "-"], stdin=src, **kw))


async def assert_alive(edge, sid) -> None:
    r = await run(edge, sid, "echo alive", timeout=20)
    assert (r.stdout, r.exit_code) == ("alive\n", 0), r


def sha(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def host_canary() -> Iterator[Path]:
    """A host-only file the sandbox must never see or change."""
    p = Path(f"/tmp/dsec-host-canary-{secrets.token_hex(6)}")
    p.write_bytes(b"host canary: do not touch\n")
    os.chmod(p, 0o666)  # even world-writable: only namespaces protect it
    yield p
    p.unlink(missing_ok=True)


def canary_state(p: Path) -> tuple[bytes, int, int, int]:
    st = p.stat()
    return p.read_bytes(), st.st_mtime_ns, st.st_ino, st.st_nlink


# --- processes -----------------------------------------------------------------------


async def test_host_processes_invisible(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    marker = f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(999) + 1}"
    host_proc = subprocess.Popen(["sleep", marker])  # a host process with a unique argv
    try:
        assert marker in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        host_init = Path("/proc/1/cmdline").read_bytes().replace(b"\0", b" ").strip().decode()
        r = await run(edge, sb.id, "ps -eo pid=,args=")
        assert r.exit_code == 0, r.stderr
        procs = [line.split(None, 1) for line in r.stdout.strip().splitlines()]
        if backend == "microvm":
            # Its own kernel: the guest's kernel threads ([name]), then the agent and ours.
            procs = [p for p in procs if not p[1].startswith("[")]
            assert [a for _, a in procs] == ["/init", "/bin/sh -c ps -eo pid=,args=", "ps -eo pid=,args="]
            init = "/init"
        else:
            # Exactly: PID 1 (the shim; in gVisor the holder of the exec's level, a copy of it),
            # our shell, and ps itself. (The container's shim has a thread per exec level:
            # pids 2 to 9.)
            assert [p for p, _ in procs][:1] == ["1"] and len(procs) == 3, r.stdout
            init = "/.dsec/shim init gvisor" if backend == "gvisor" else "/.dsec/shim init"
        assert procs[0][1] == init
        assert marker not in r.stdout
        assert "pytest" not in r.stdout
        # Raw /proc agrees with ps: nothing from the host behind the pid namespace.
        r = await py(
            edge,
            sb.id,
            "import os\n"
            "for p in sorted(int(x) for x in os.listdir('/proc') if x.isdigit()):\n"
            "    try:\n"  # (a process that ended meanwhile: a microVM's guest kernel threads come and go)
            "        print(p, open(f'/proc/{p}/cmdline','rb').read().replace(b'\\0', b' ').decode())\n"
            "    except FileNotFoundError:\n"
            "        pass\n",
        )
        assert r.exit_code == 0, r.stderr
        assert marker not in r.stdout and "pytest" not in r.stdout
        assert r.stdout.splitlines()[0].rstrip() == f"1 {init}"
        assert host_init != "/.dsec/shim init" and host_init not in r.stdout
        assert str(os.getpid()) not in [line.split()[0] for line in r.stdout.splitlines()]
        # Signalling a host pid from inside reaches nothing.
        r = await run(edge, sb.id, f"kill -9 {host_proc.pid}; echo rc=$?")
        assert "rc=1" in r.stdout
        assert host_proc.poll() is None
    finally:
        host_proc.kill()
        host_proc.wait()


# --- network -------------------------------------------------------------------------


def _host_ipv4_addrs() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    return sorted({m.group(1) for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/", out)})


async def test_no_network(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))  # covers the host's 127.0.0.1 and every other host address
    listener.listen(16)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    abstract = f"\0dsec-canary-{secrets.token_hex(6)}"
    unix_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_listener.bind(abstract)
    unix_listener.listen(4)
    unix_listener.setblocking(False)
    try:
        # Sanity: the host itself can reach the listener.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        conn, _ = listener.accept()
        conn.close()
        targets = ["127.0.0.1", *[a for a in _host_ipv4_addrs() if a != "127.0.0.1"], "1.1.1.1"]
        r = await py(
            edge,
            sb.id,
            "import socket, errno\n"
            f"for host in {targets!r}:\n"
            "    s = socket.socket(); s.settimeout(3)\n"
            f"    try: s.connect((host, {port})); print(host, 'CONNECTED')\n"
            "    except OSError as e: print(host, errno.errorcode.get(e.errno, e))\n"
            "u = socket.socket(socket.AF_UNIX)\n"
            f"try: u.connect({abstract!r}); print('abstract CONNECTED')\n"
            "except OSError as e: print('abstract', errno.errorcode.get(e.errno, e))\n"
            # the sandbox's own loopback works: the refusal above is isolation, not a broken test
            "srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(1)\n"
            "c = socket.create_connection(srv.getsockname(), timeout=2); print('own-loopback ok')\n",
            timeout=30,
        )
        assert r.exit_code == 0, r.stderr
        lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
        assert "CONNECTED" not in r.stdout, r.stdout
        assert lines["127.0.0.1"] == "ECONNREFUSED"  # the sandbox's own, empty, loopback
        for t in targets[1:]:
            assert lines[t] in ("ENETUNREACH", "EHOSTUNREACH"), (t, lines[t])
        assert lines["abstract"] == "ECONNREFUSED"  # abstract unix sockets are per netns
        assert lines["own-loopback"] == "ok"
        with pytest.raises(BlockingIOError):
            listener.accept()
        with pytest.raises(BlockingIOError):
            unix_listener.accept()
        # Only the loopback interface exists.
        r = await run(edge, sb.id, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; ls /sys/class/net")
        # (gVisor's sysfs has no class/net: /proc/net/dev is its view. A microVM has its NIC,
        # whose other end, in QEMU's network namespace on the host, leads nowhere without a policy.)
        want = {"gvisor": ["lo"], "microvm": ["lo", "eth0", "eth0", "lo"]}.get(backend, ["lo", "lo"])
        assert r.stdout.split() == want, r.stdout
        r = await run(edge, sb.id, "curl -sS --max-time 3 http://1.1.1.1/ -o /dev/null")
        assert r.exit_code != 0
    finally:
        listener.close()
        unix_listener.close()


# --- privileged operations -----------------------------------------------------------


async def test_mount_ptrace_unshare_denied(edge, backend):
    # The first sandbox of an edge gets the profile compiled by crun; later ones get that
    # program back precompiled (annotation run.oci.seccomp_bpf_data): both must hold.
    first = await edge.create(SandboxSpec(image="python", backend=backend))
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    if backend != "container":
        # microVM: the same profile, compiled on the host, installed by the guest agent;
        # gVisor: compiled on the host too, installed by each exec level's holder (the init
        # makes PID namespaces, which the profile refuses: the OCI config has none)
        for x in (first, sb):
            await check_denied(edge, x)
        return
    configs = [json.loads((edge.sandboxes[x.id].handle.dir / "config.json").read_text()) for x in (first, sb)]
    assert "seccomp" in configs[0]["linux"] and "run.oci.seccomp_bpf_data" not in configs[0].get(
        "annotations", {}
    )
    later = configs[1]["linux"]["seccomp"]
    assert "syscalls" not in later and configs[1]["annotations"]["run.oci.seccomp_bpf_data"]
    assert later["flags"] == ["SECCOMP_FILTER_FLAG_LOG"]  # denials are still logged (and counted)
    for x in (first, sb):
        await check_denied(edge, x)


async def check_denied(edge, sb):
    r = await py(
        edge,
        sb.id,
        "import ctypes, errno, os, time\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "def res(name, rc):\n"
        "    print(name, 'OK' if rc == 0 else errno.errorcode[ctypes.get_errno()])\n"
        "res('mount_tmpfs', libc.mount(b'none', b'/mnt', b'tmpfs', 0, None))\n"
        "res('mount_proc', libc.mount(b'proc', b'/mnt', b'proc', 0, None))\n"
        "res('remount_sys_rw', libc.mount(None, b'/sys', None, 32 | 4096, None))\n"  # MS_REMOUNT|MS_BIND
        "res('umount_proc', libc.umount2(b'/proc/kcore', 2))\n"
        "res('chroot', libc.chroot(b'/tmp'))\n"
        "res('ptrace_traceme', libc.ptrace(0, 0, None, None))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(30); os._exit(0)\n"
        "res('ptrace_attach_child', libc.ptrace(16, pid, None, None))\n"
        "res('ptrace_seize_child', libc.ptrace(0x4206, pid, None, None))\n"
        "os.kill(pid, 9); os.waitpid(pid, 0)\n"
        "for name, flag in [('userns', 0x10000000), ('mntns', 0x20000), ('netns', 0x40000000),\n"
        "                   ('pidns', 0x20000000), ('utsns', 0x04000000), ('cgroupns', 0x02000000)]:\n"
        "    res('unshare_' + name, libc.unshare(flag))\n"
        "res('setns_net', libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0))\n"
        "res('sethostname', libc.sethostname(b'pwned', 5))\n"
        "res('mknod_block', libc.mknod(b'/tmp/sda', 0o60600, (8 << 8) | 0))\n",
    )
    assert r.exit_code == 0, r.stderr
    got = dict(line.split() for line in r.stdout.strip().splitlines())
    assert set(got.values()) == {"EPERM"}, got  # every single attempt is refused, none succeeds
    assert len(got) == 17
    # The binaries a user would reach for fail the same way.
    r = await run(edge, sb.id, "unshare --user --map-root-user true; echo rc=$?; unshare -m true; echo rc=$?")
    assert r.stdout == "rc=1\nrc=1\n" and "Operation not permitted" in r.stderr
    r = await run(edge, sb.id, "mount -t tmpfs none /mnt; echo rc=$?")
    assert r.stdout.strip() != "rc=0"
    r = await run(edge, sb.id, "hostname")
    assert r.stdout.strip() == sb.id  # sethostname above did not take


async def test_kernel_interfaces_masked_and_readonly(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    host_hostname = socket.gethostname()
    core_pattern = Path("/proc/sys/kernel/core_pattern").read_text()
    r = await py(
        edge,
        sb.id,
        "import os, errno\n"
        "for p in ['/proc/kcore', '/proc/kpagecgroup', '/proc/kpageflags', '/proc/kpagecount',\n"
        "          '/proc/keys', '/proc/timer_list', '/proc/sysrq-trigger',\n"
        "          '/proc/sys/kernel/core_pattern']:\n"
        "    try:\n"
        "        fd = os.open(p, os.O_RDONLY)\n"
        "        data = os.read(fd, 4096); os.close(fd)\n"
        "        print(p, 'DATA' if data else 'EMPTY')\n"
        "    except OSError as e: print(p, errno.errorcode[e.errno])\n"
        "for p, v in [('/proc/sys/kernel/hostname', 'pwned'), ('/proc/sys/vm/drop_caches', '3'),\n"
        "             ('/proc/sys/kernel/core_pattern', '|/tmp/x'), ('/proc/sysrq-trigger', 'h'),\n"
        "             ('/sys/kernel/mm/transparent_hugepage/enabled', 'never'),\n"
        "             ('/sys/class/net/lo/mtu', '1000')]:\n"
        "    try:\n"
        "        with open(p, 'w') as f: f.write(v)\n"
        "        print(p, 'WRITTEN')\n"
        "    except OSError as e: print(p, errno.errorcode[e.errno])\n",
    )
    assert r.exit_code == 0, r.stderr
    got = dict(line.split() for line in r.stdout.strip().splitlines())
    # Kernel memory and page maps: absent, or masked by /dev/null (reads nothing).
    for p in ("/proc/kcore", "/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount"):
        assert got[p] in ("ENOENT", "EACCES", "EPERM", "EMPTY"), (p, got[p])
    assert "DATA" not in {got[p] for p in ("/proc/keys", "/proc/timer_list")}
    written = {p for p, v in got.items() if v == "WRITTEN"}
    assert written <= {"/proc/sys/kernel/core_pattern"}, written  # masked by /dev/null: harmless
    # gVisor's /proc/sys is its own and refuses writes with EIO
    assert got["/proc/sys/kernel/hostname"] == ("EIO" if backend == "gvisor" else "EROFS")
    assert Path("/proc/sys/kernel/core_pattern").read_text() == core_pattern  # masked: a write hits /dev/null
    assert got["/proc/sys/vm/drop_caches"] == ("EPERM" if backend == "gvisor" else "EROFS")
    assert socket.gethostname() == host_hostname
    r = await run(edge, sb.id, "cat /proc/sys/kernel/hostname; grep -c ' /proc/sys ' /proc/mounts")
    assert r.stdout.split()[0] == sb.id


async def test_capabilities_minimal(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    r = await run(
        edge, sb.id, "grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status"
    )
    st = {k: v.strip() for k, v in (line.split(":", 1) for line in r.stdout.strip().splitlines())}
    want = sum(1 << CAP_BITS[c] for c in CAPABILITIES)
    assert want == 0x4FB
    if backend == "gvisor":
        want |= 1 << 34  # CAP_SYSLOG: dmesg reads gVisor's own kernel log there
    for k in ("CapPrm", "CapEff", "CapBnd"):
        assert int(st[k], 16) == want, (k, st[k])
    assert int(st["CapInh"], 16) == 0 and int(st.get("CapAmb", "0"), 16) == 0  # (gVisor has no CapAmb line)
    eff = int(st["CapEff"], 16)
    for dangerous in (
        "CAP_SYS_ADMIN",
        "CAP_SYS_PTRACE",
        "CAP_NET_ADMIN",
        "CAP_NET_RAW",
        "CAP_SYS_MODULE",
        "CAP_SYS_RAWIO",
        "CAP_MKNOD",
        "CAP_DAC_READ_SEARCH",
        "CAP_SYS_CHROOT",
        "CAP_SETPCAP",
    ):
        assert not eff & (1 << CAP_BITS[dangerous]), dangerous
    assert st.get("NoNewPrivs", "1") == "1"  # (gVisor's status has no such line; the spec sets it)
    assert st["Seccomp"] == "2"  # filter mode
    # A non-root user inside has nothing at all.
    r = await run(edge, sb.id, "grep CapEff /proc/self/status", user="1000")
    assert int(r.stdout.split()[1], 16) == 0
    # Root inside maps to an unprivileged host id range.
    handle = edge.sandboxes[sb.id].handle
    assert handle.id_base >= edge.settings.uid_offset + 65536  # its own range, above the layer store's
    if backend == "microvm":
        # Root of its own kernel; on the host, its QEMU runs as the sandbox's own unprivileged
        # id, with no capabilities, no new privileges and QEMU's seccomp filter.
        status = dict(
            line.split(":", 1) for line in Path(f"/proc/{handle.pid}/status").read_text().splitlines()
        )
        assert status["Uid"].split() == [str(handle.id_base)] * 4, status["Uid"]
        assert status["Gid"].split() == [str(handle.id_base)] * 4 and status["Groups"].strip() == ""
        for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(status[k], 16) == 0, (k, status[k])
        assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
        return
    if backend == "gvisor":
        # Inside is gVisor's own user namespace; on the host its sentry and gofer (the keeper's
        # children) run in a user namespace mapping root to the sandbox's own range.
        kids = []
        for tid in os.listdir(f"/proc/{handle.pid}/task"):
            kids += [int(x) for x in Path(f"/proc/{handle.pid}/task/{tid}/children").read_text().split()]
        assert len(kids) == 2, kids
        for kid in kids:
            uids = next(
                line
                for line in Path(f"/proc/{kid}/status").read_text().splitlines()
                if line.startswith("Uid:")
            )
            assert uids.split()[1:] == [str(handle.id_base)] * 4, uids
            assert Path(f"/proc/{kid}/uid_map").read_text().split() == ["0", str(handle.id_base), "65536"]
        return
    r = await run(edge, sb.id, "cat /proc/self/uid_map")
    inside, outside, count = r.stdout.split()
    assert (inside, count) == ("0", "65536")
    assert int(outside) == handle.id_base


# --- the host file system --------------------------------------------------------------


async def test_host_files_unreachable_from_inside(edge, backend, host_canary):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    before = canary_state(host_canary)
    passwd_before = sha("/etc/passwd")
    name = host_canary.name
    # Not visible by any path a process inside can spell.
    paths = [
        f"/tmp/{name}",
        f"/proc/1/root/tmp/{name}",
        f"/proc/self/root/tmp/{name}",
        f"/proc/self/cwd/../../../../../tmp/{name}",
        f"/../../../../tmp/{name}",
        f"/dev/fd/../../tmp/{name}",
    ]
    r = await run(
        edge,
        sb.id,
        "for p in " + " ".join(paths) + "; do cat $p 2>/dev/null && echo LEAK $p; done; "
        f"find / -xdev -name '{name}' 2>/dev/null; echo done",
    )
    assert r.stdout == "done\n", r.stdout
    # Writes by every path land in the sandbox, or fail.
    r = await run(
        edge,
        sb.id,
        "for p in " + " ".join(paths) + "; do echo pwned >> $p 2>/dev/null; done; cat /tmp/" + name,
    )
    assert "pwned" in r.stdout  # the sandbox's own /tmp got the file
    assert canary_state(host_canary) == before
    # /etc/passwd written inside changes the sandbox's copy only.
    r = await run(edge, sb.id, "echo 'evil:x:0:0::/root:/bin/sh' >> /etc/passwd && tail -n1 /etc/passwd")
    assert r.stdout == "evil:x:0:0::/root:/bin/sh\n"
    assert sha("/etc/passwd") == passwd_before
    assert "evil" not in Path("/etc/passwd").read_text()
    # ... and not the shared image layer: a fresh sandbox of the same image has the original.
    sb2 = await edge.create(SandboxSpec(image="python", backend=backend))
    r = await run(edge, sb2.id, "grep -c '^evil:' /etc/passwd || true")
    assert r.stdout.strip() == "0"
    # Root inside is not root on the host: objects owned by host root show as unmapped "nobody".
    r = await run(edge, sb.id, "stat -c %u /proc/sys/kernel/hostname /sys/block")
    # (under gVisor and in a microVM these are the sandbox's own kernel's objects, not the host's)
    own_kernel = backend in ("gvisor", "microvm")
    assert r.stdout.split() == (["0", "0"] if own_kernel else ["65534", "65534"]), r.stdout


async def test_file_api_escapes_refused(edge, backend, host_canary):
    require(edge, backend, Capability.FILES)
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    name = host_canary.name
    before = canary_state(host_canary)
    shadow_before = sha("/etc/shadow")
    passwd_before = sha("/etc/passwd")
    up = "../" * 12
    r = await run(
        edge,
        sb.id,
        f"ln -s /tmp/{name} /work/l1 && ln -s {up}tmp/{name} /work/l2 && "
        "ln -s /proc/self/root/etc/shadow /work/l3 && ln -s /proc/1/root/tmp /work/l4 && "
        "ln -s / /work/l5 && ln -s /etc/passwd /work/l6 && ln -s /work/loop /work/loop && "
        f"ln -s /proc/self/cwd/../../../../tmp/{name} /work/l7 && "
        f"ln -s {up}{up} /work/dotdot && mkdir -p /work/d && ln -s ../../../../.. /work/d/up",
    )
    assert r.exit_code == 0, r.stderr
    ok = (
        errors.PathEscape,
        errors.FileNotFound,
        errors.Forbidden,
        errors.InvalidRequest,
        errors.EditMismatch,
    )
    host_data = host_canary.read_bytes()

    async def attempt(fn, *args):
        try:
            res = fn(sb.id, *args)
            return await res if inspect.isawaitable(res) else res
        except ok as e:
            return e

    # Reads: an error, or the sandbox's own file, never the host's.
    for p in [
        "/work/l1",
        "/work/l2",
        "/work/l3",
        "/work/l4/" + name,
        "/work/l7",
        "/work/loop",
        f"/work/{up}tmp/{name}",
        f"/work/d/up/tmp/{name}",
        f"/work/dotdot/tmp/{name}",
        "/work/l5/etc/shadow",
        "/work/l3/../shadow",
        f"/proc/self/root/tmp/{name}",
    ]:
        res = await attempt(edge.read_file, p)
        assert isinstance(res, Exception) or res != host_data, p
        if isinstance(res, bytes):
            assert res != Path("/etc/shadow").read_bytes(), p
    # The classic `..` climb resolves inside the sandbox's root: the file read is the sandbox's.
    await edge.write_file(sb.id, "/etc/dsec-own", b"sandbox's own\n")
    assert await edge.read_file(sb.id, f"/work/{up}etc/dsec-own") == b"sandbox's own\n"
    assert await edge.read_file(sb.id, f"/work/l5/work/{up}etc/dsec-own") == b"sandbox's own\n"
    assert not os.path.exists("/etc/dsec-own")
    # Listing through a link to / shows the sandbox's root (which has the shim), not the host's.
    names = {e.name for e in await edge.list_dir(sb.id, "/work/l5")}
    assert ".dsec" in names
    assert not os.path.exists("/.dsec")
    res = await attempt(edge.list_dir, "/work/l4")
    assert isinstance(res, Exception) or name not in {e.name for e in res}
    # Writes: refused, or they land inside the sandbox.
    for p in [
        "/work/l1",
        "/work/l2",
        "/work/l3",
        "/work/l4/" + name,
        "/work/l7",
        f"/work/{up}tmp/{name}",
        f"/work/d/up/tmp/{name}",
        f"/work/dotdot/tmp/{name}",
    ]:
        await attempt(edge.write_file, p, b"pwned by file api\n")
        res = await attempt(edge.edit_file, p, "host canary", "PWNED")
        assert canary_state(host_canary) == before, p
    # The `..` write above created the sandbox's own /tmp/<name>, visible from inside only.
    r = await run(edge, sb.id, f"cat /tmp/{name}")
    assert "pwned by file api" in r.stdout
    # Write through a link to /etc/passwd: changes the sandbox's passwd only.
    await edge.write_file(sb.id, "/work/l6", b"root:x:0:0:sandbox:/root:/bin/sh\n")
    r = await run(edge, sb.id, "cat /etc/passwd")
    assert r.stdout == "root:x:0:0:sandbox:/root:/bin/sh\n"
    assert sha("/etc/passwd") == passwd_before
    # Delete, stat through the same links: never touch the host.
    for p in ["/work/l1", "/work/l2", "/work/l7", f"/work/{up}tmp/{name}", f"/work/d/up/tmp/{name}"]:
        with contextlib.suppress(*ok):
            await edge.stat_file(sb.id, p)
        with contextlib.suppress(*ok):
            await edge.delete_file(sb.id, p)
    # Through a link to /, the delete hits the sandbox's own /tmp/<name> (written above), not the host's.
    await edge.write_file(sb.id, f"/tmp/{name}", b"sandbox side\n")
    await edge.delete_file(sb.id, f"/work/l5/tmp/{name}")
    r = await run(edge, sb.id, f"test -e /tmp/{name}; echo rc=$?")
    assert r.stdout == "rc=1\n"
    assert canary_state(host_canary) == before
    assert sha("/etc/shadow") == shadow_before
    # Symlink loops are reported as escapes, not hangs.
    with pytest.raises((errors.PathEscape, errors.FileNotFound)):
        await edge.read_file(sb.id, "/work/loop")


# --- resource limits -----------------------------------------------------------------


def _sandbox_memory_cgroup(edge, sid: str) -> Path:
    cg = edge.cgroups
    if cg.version == 2:
        return cg.root / "dsec" / sid
    return cg.v1_mounts.get("memory", cg.root / "memory") / "dsec" / sid


async def test_memory_limit_oom_kills_inside_only(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend, memory_mb=64))
    t0 = time.perf_counter()
    if backend == "gvisor":
        # The limit is on the host cgroup of the sentry, whose OOM kill ends the whole sandbox
        # (gVisor enforces no memory limit inside): the sandbox fails and says why, the host
        # and the edge are fine.
        with pytest.raises(errors.DsecError):
            await run(edge, sb.id, "python3 -c 'b = b\"x\" * (200 * 1024 * 1024); print(len(b))'", timeout=60)
        for _ in range(100):
            if edge.get(sb.id).state == "failed":
                break
            await asyncio.sleep(0.05)
        info = edge.get(sb.id)
        assert info.state == "failed" and "out-of-memory" in (info.reason or ""), info
        assert time.perf_counter() - t0 < 30
        return
    r = await run(edge, sb.id, "python3 -c 'b = b\"x\" * (200 * 1024 * 1024); print(len(b))'", timeout=60)
    assert r.exit_code == 137, r  # SIGKILL by the OOM killer
    assert r.stdout == "" and not r.timed_out
    assert time.perf_counter() - t0 < 30
    # It was the sandbox's cgroup that went OOM, not the host.
    cg = _sandbox_memory_cgroup(edge, sb.id)
    if backend == "microvm":
        # The guest's own cgroup of the sandbox's processes went OOM (memory_mb); QEMU's host
        # cgroup (guest RAM + QEMU's own) did not.
        ctl = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        assert int(ctl.get("oom_kill", "0")) == 0
        r = await run(edge, sb.id, "cat /proc/meminfo | head -1")
        assert int(r.stdout.split()[1]) > 64 * 1024  # the VM is larger than its processes' share
    elif edge.cgroups.version == 2:
        events = dict(line.split() for line in (cg / "memory.events").read_text().splitlines())
        assert int(events["oom_kill"]) >= 1
    else:
        ctl = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        assert int(ctl.get("oom_kill", "1")) >= 1
        assert int((cg / "memory.limit_in_bytes").read_text()) == 64 * 1024 * 1024
    # The shim survived and the sandbox still works, including allocation within the limit.
    await assert_alive(edge, sb.id)
    r = await run(edge, sb.id, "python3 -c 'b = b\"x\" * (16 * 1024 * 1024); print(len(b))'")
    assert (r.exit_code, r.stdout) == (0, f"{16 * 1024 * 1024}\n")
    # The test process (and the edge in it) is fine.
    assert edge.get(sb.id).state == "running"


async def test_fork_bomb_contained_by_pids_limit(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend, pids=64))
    # The classic bomb; `exec sleep` (no fork needed) keeps the exec alive until its timeout.
    t0 = time.perf_counter()
    r = await run(edge, sb.id, ["bash", "-c", ":(){ :|:& };:; exec sleep 100"], timeout=3)
    elapsed = time.perf_counter() - t0
    assert r.timed_out and r.exit_code == 137, r
    assert "Resource temporarily unavailable" in r.stderr  # fork hit the pids limit
    assert elapsed < 15
    await assert_alive(edge, sb.id)
    # A Python bomb that keeps forking and never exits.
    r = await py(
        edge,
        sb.id,
        "import os, time\n"
        "fails = 0\n"
        "while True:\n"
        "    try: os.fork()\n"
        "    except OSError: fails += 1; time.sleep(0.001)\n",
        timeout=4,
    )
    assert r.timed_out and r.exit_code == 137
    # The limit is what held it: the pids cgroup of the sandbox's processes hit its max
    # (the sandbox's own cgroup keeps a reserve so its init can always start an exec).
    if backend == "gvisor":  # the limit is RLIMIT_NPROC inside (a host pids limit would crash the sentry)
        r = await py(edge, sb.id, "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])")
        assert r.stdout.strip() == "64", r
    elif backend == "microvm":  # the guest's cgroup of the sandbox's processes holds the limit
        pass  # (no cgroup file system is visible inside: the refused forks above are the proof)
    else:
        assert (edge.cgroups.user_dir(sb.id) / "pids.max").read_text().strip() == "64"
    # Everything was killed and the sandbox answers again.
    await assert_alive(edge, sb.id)
    r = await run(edge, sb.id, "ps -e --no-headers -o args | grep -cv '^\\['")  # (not kernel threads)
    assert int(r.stdout) <= 4, r.stdout  # shim, sh, ps, grep
    # The host can still fork.
    assert subprocess.run(["true"]).returncode == 0


async def test_timeout_kills_grandchildren(edge, backend):
    # (gVisor: no host cgroup holds an exec; its level, a PID namespace, does: setsid stays in it)
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    t0 = time.perf_counter()
    r = await run(
        edge, sb.id, "setsid sleep 301 & (setsid sh -c 'sleep 302 & wait' &) ; sleep 300", timeout=1
    )
    assert r.timed_out and r.exit_code == 137
    assert time.perf_counter() - t0 < 10
    r = await run(edge, sb.id, "pgrep -a sleep; echo rc=$?")
    assert r.stdout == "rc=1\n", r.stdout
    r = await run(edge, sb.id, "ps -e --no-headers -o args")
    assert "sleep" not in r.stdout
    # Host side: no exec cgroups left behind (a microVM's are in its guest, gVisor has none).
    if backend == "container":
        assert [p.name for p in edge.cgroups.user_dir(sb.id).iterdir() if p.is_dir()] == []


async def test_output_flood_capped(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend, disk_mb=64))
    used = "df -B1 --output=used / | tail -n1"
    before = int((await run(edge, sb.id, used)).stdout)
    cap = 1_000_000
    t0 = time.perf_counter()
    r = await run(edge, sb.id, "yes", max_output_bytes=cap, timeout=30)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5, elapsed
    assert r.truncated and not r.timed_out
    assert 0 < len(r.stdout.encode()) <= cap
    assert set(r.stdout.split("\n")[:-1]) == {"y"}
    # Same for both streams at once, through a shell.
    r = await run(edge, sb.id, "yes out & yes err >&2", max_output_bytes=cap, timeout=30)
    assert r.truncated and len(r.stdout.encode()) <= cap and len(r.stderr.encode()) <= cap
    # Nothing was spooled to the sandbox's disk, and no `yes` is left running.
    after = int((await run(edge, sb.id, used)).stdout)
    assert after - before < 256 * 1024, (before, after)
    r = await run(edge, sb.id, "pgrep yes; echo rc=$?")
    assert r.stdout == "rc=1\n"
    # ... nor on the host: the edge's run dir (excluding the sandboxes' own mounts and the
    # trusted tools every sandbox binds read-only: `tools`, and gVisor's readable copy of them,
    # `tools-gvisor`) stays small.
    total = 0
    tools = {os.path.join(edge.settings.edge_run_dir, t) for t in ("tools", "tools-gvisor")}
    for root, dirs, files in os.walk(edge.settings.edge_run_dir):
        paths = [os.path.join(root, d) for d in dirs]
        dirs[:] = [os.path.basename(p) for p in paths if not os.path.ismount(p) and p not in tools]
        # (a microVM's writable layer is its disk file here: its own mount, in effect)
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files if f != "rw.ext4")
    assert total < 1024 * 1024, total
    # Sanity: the disk measurement does see real writes.
    r = await run(edge, sb.id, f"head -c 4000000 /dev/zero > /tmp/z && {used}")
    assert int(r.stdout) - after >= 3_000_000


# --- sandboxes vs each other -------------------------------------------------------------


async def test_sandboxes_isolated_from_each_other(edge, backend):
    a = await edge.create(SandboxSpec(image="python", backend=backend))
    b = await edge.create(SandboxSpec(image="python", backend=backend))
    tag = secrets.token_hex(6)
    await run(
        edge, a.id, "echo $T > /work/marker-$T && echo $T > /tmp/m && echo $T > /dev/shm/m", env={"T": tag}
    )
    bg = asyncio.ensure_future(
        run(edge, a.id, f"sleep 300.{secrets.randbelow(900) + 100} # {tag}", timeout=60)
    )
    bg_arg = None
    for _ in range(50):
        r = await run(edge, a.id, "ps -eo args= | grep '^sleep 300' || true")
        if r.stdout:
            bg_arg = r.stdout.strip()
            break
        await asyncio.sleep(0.05)
    assert bg_arg, "the sleep did not start in A"
    try:
        # (the tag is never on B's command lines, so B's own ps cannot echo it back)
        r = await run(
            edge, b.id, "ls /work; cat /tmp/m /dev/shm/m 2>&1; ps -eo args=; find / -xdev -name 'marker-*'"
        )
        assert tag not in r.stdout
        assert "sleep 300" not in r.stdout
        r = await run(edge, b.id, "pkill -9 sleep; echo rc=$?")
        assert "rc=1" in r.stdout
        # SysV IPC and abstract unix sockets are private to each sandbox too.
        if backend == "gvisor":  # (no /proc/sysvipc to list there: B names A's segment instead)
            shmid = (await run(edge, a.id, "ipcmk -M 4096 | grep -o '[0-9]*$'")).stdout.strip()
            assert shmid.isdigit()
            r = await run(edge, b.id, f"ipcrm -m {shmid}; echo rc=$?")
            assert "rc=0" not in r.stdout, r
            assert (await run(edge, a.id, f"ipcrm -m {shmid}; echo rc=$?")).stdout.strip() == "rc=0"
        else:
            r = await run(edge, a.id, "ipcmk -M 4096 >/dev/null && ipcs -m | grep -c '^0x'")
            assert r.stdout.strip() == "1"
            r = await run(edge, b.id, "ipcs -m | grep -c '^0x' || true")
            assert r.stdout.strip() == "0"
        sock = f"\\0dsec-ab-{tag}"
        srv = asyncio.ensure_future(
            py(
                edge,
                a.id,
                f"import socket,time\ns=socket.socket(socket.AF_UNIX); s.bind('{sock}'); s.listen(1)\n"
                "print('up', flush=True); time.sleep(20)",
                timeout=30,
            )
        )
        await asyncio.sleep(0.5)
        r = await py(
            edge,
            b.id,
            f"import socket\ns=socket.socket(socket.AF_UNIX)\n"
            f"try: s.connect('{sock}'); print('CONNECTED')\nexcept OSError as e: print(e.errno)",
        )
        assert r.stdout.strip() == "111", r  # ECONNREFUSED
        srv.cancel()
        # The files API of B cannot name A's files either.
        if Capability.FILES in edge.backends[backend].capabilities:
            with pytest.raises(errors.FileNotFound):
                await edge.read_file(b.id, f"/work/marker-{tag}")
            assert await edge.read_file(a.id, f"/work/marker-{tag}") == f"{tag}\n".encode()
        # A's sleep is still alive after B's attempts.
        r = await run(edge, a.id, "ps -eo args=")
        assert bg_arg in r.stdout
    finally:
        bg.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await bg


# --- the shim (PID 1) -------------------------------------------------------------------


async def test_shim_untouchable(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    for sig in ("KILL", "TERM", "INT", "HUP", "SEGV", "STOP", "USR1"):
        r = await run(edge, sb.id, f"kill -{sig} 1; echo rc=$?")
        assert r.exit_code == 0, r
        await assert_alive(edge, sb.id)
    r = await run(edge, sb.id, "grep State /proc/1/status")
    assert "T (stopped)" not in r.stdout and "Z" not in r.stdout.split()[1]
    r = await py(
        edge,
        sb.id,
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for p in ['/proc/1/environ', '/proc/1/mem', '/proc/1/maps', '/proc/1/root/etc/hostname',\n"
        "          '/proc/1/cwd', '/proc/1/fd/3', '/proc/1/fd/4', '/proc/1/fd/0']:\n"
        "    try: fd = os.open(p, os.O_RDONLY); print(p, 'OPEN'); os.close(fd)\n"
        "    except OSError as e: print(p, errno.errorcode[e.errno])\n"
        "for n in range(6):\n"
        "    try: os.readlink(f'/proc/1/fd/{n}'); print(f'readlink{n}', 'OK')\n"
        "    except OSError as e: print(f'readlink{n}', errno.errorcode[e.errno])\n"
        "try: pfd = os.pidfd_open(1)\n"
        "except OSError as e: pfd = -1; print('pidfd_open', errno.errorcode[e.errno])\n"
        "for n in range(6):\n"
        "    r = libc.syscall(438, pfd, n, 0) if pfd >= 0 else -1\n"  # pidfd_getfd
        "    e = 'OK' if r >= 0 else errno.errorcode[ctypes.get_errno()] if pfd >= 0 else 'EPERM'\n"
        "    print(f'getfd{n}', e)\n"
        "r = libc.ptrace(16, 1, None, None)\n"
        "print('ptrace1', 'OK' if r == 0 else errno.errorcode[ctypes.get_errno()])\n"
        "buf = ctypes.create_string_buffer(8)\n"
        "class iov(ctypes.Structure): _fields_ = [('b', ctypes.c_void_p), ('l', ctypes.c_size_t)]\n"
        "l, rm = iov(ctypes.addressof(buf), 8), iov(0x400000, 8)\n"
        "r = libc.process_vm_readv(1, ctypes.byref(l), 1, ctypes.byref(rm), 1, 0)\n"
        "print('vmread', 'OK' if r >= 0 else errno.errorcode[ctypes.get_errno()])\n",
    )
    assert r.exit_code == 0, r.stderr
    got = dict(line.split() for line in r.stdout.strip().splitlines())
    if backend == "gvisor":
        # gVisor's /proc ignores the shim's non-dumpable flag for these two (its environment is
        # the sandbox's own, its map a static binary's); pidfd_open(1) is refused outright.
        assert got.pop("/proc/1/environ") == "OPEN" and got.pop("/proc/1/maps") == "OPEN"
        assert got["pidfd_open"] == "EPERM"
        # Its descriptors can be named (no masked paths there) but not reopened: stdio is
        # /dev/null, the control socket gives ENXIO (checked above: /proc/1/fd/3).
        assert got.pop("/proc/1/fd/0") == "OPEN" and got["/proc/1/fd/3"] == "ENXIO"
        for n in range(6):
            got.pop(f"readlink{n}")
    assert "OK" not in got.values() and "OPEN" not in got.values(), got
    for n in range(6):
        assert got[f"getfd{n}"] == "EPERM"
    assert got["ptrace1"] == "EPERM" and got["vmread"] == "EPERM"
    if backend != "gvisor":
        r = await run(edge, sb.id, "cat /proc/1/environ")
        assert r.exit_code != 0 and "Permission denied" in r.stderr
    await assert_alive(edge, sb.id)


async def test_pid1_limits_and_io_signals_are_out_of_reach(edge, backend):
    """Other ways to the shim than a signal: its resource limits (with 5 descriptors it could
    take no exec's stdio) and an I/O signal (F_SETOWN 1 + F_SETSIG SIGKILL: gVisor gives PID 1
    no init protection). Threads still start (libc's clone3 fallback works)."""
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    r = await py(
        edge,
        sb.id,
        "import ctypes, errno, fcntl, os, resource, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join(); print('thread ok')\n"
        "for lim in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC):\n"
        "    try: resource.prlimit(1, lim, (1, 1)); print('prlimit OK')\n"
        "    except OSError as e: print('prlimit', errno.errorcode[e.errno])\n"
        "r, w = os.pipe(); fcntl.fcntl(r, fcntl.F_SETOWN, 1)\n"
        "rc = libc.fcntl(r, 10, 9)\n"  # F_SETSIG SIGKILL
        "fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK); os.write(w, b'x')\n"
        "print('setsig', rc)\n",
    )
    assert r.exit_code == 0, r
    assert r.stdout.startswith("thread ok\nprlimit EPERM\nprlimit EPERM\n"), r.stdout
    await assert_alive(edge, sb.id)
    assert (await run(edge, sb.id, "echo still")).stdout == "still\n"


async def test_shim_fd_dir_not_listable(edge, backend):
    # The shim's proc entries belong to the sandbox's root (it is non-dumpable, but in the
    # sandbox's user namespace): its descriptor dirs are masked instead.
    sb = await edge.create(SandboxSpec(image="python", backend=backend))
    if backend == "gvisor":
        # gVisor applies no masked paths: the numbers can be listed, none can be reopened.
        r = await py(
            edge,
            sb.id,
            "import os\nfor n in os.listdir('/proc/1/fd'):\n"
            "    p = f'/proc/1/fd/{n}'\n"
            "    try: os.close(os.open(p, os.O_RDWR)); print('OPEN', n, os.readlink(p))\n"
            "    except OSError as e: pass\n",
        )
        assert "host:" not in r.stdout and "socket" not in r.stdout, r.stdout
        return
    r = await run(edge, sb.id, "ls -A /proc/1/fd /proc/1/fdinfo /proc/1/map_files")
    assert (
        r.stdout.replace("/proc/1/fd:", "")
        .replace("/proc/1/fdinfo:", "")
        .replace("/proc/1/map_files:", "")
        .strip()
        == ""
    )
    r = await run(edge, sb.id, "umount /proc/1/fd; echo rc=$?")
    assert "rc=0" not in r.stdout  # and the mask stays
    r = await run(edge, sb.id, "sleep 30 & ls /proc/$!/fd | wc -l")  # other processes are unaffected
    assert int(r.stdout.strip()) >= 3


async def test_detached_fork_bomb_does_not_wedge_sandbox(edge, backend):
    sb = await edge.create(SandboxSpec(image="python", backend=backend, pids=64))
    r = await py(
        edge,
        sb.id,
        "import os, time\n"
        "if os.fork(): os._exit(0)\n"  # detach: the exec itself returns immediately
        "os.setsid()\n"
        "while True:\n"
        "    try: os.fork()\n"
        "    except OSError: time.sleep(0.01)\n",
        timeout=5,
    )
    assert r.exit_code == 0
    # Contained: the host is fine and the sandbox's pids cgroup is pinned at its limit.
    assert subprocess.run(["true"]).returncode == 0
    # The owner must be able to get the sandbox back without destroying it: an exec (which
    # could `kill -9 -1`) has to start within a few seconds.
    deadline = time.monotonic() + 5
    while True:
        try:
            r = await run(edge, sb.id, "kill -9 -1; echo alive", timeout=10)
            break
        except errors.DsecError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    assert "alive" in r.stdout
