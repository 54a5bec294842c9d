"""Run a program (the image builder) as root of namespaces of its own:
`python -m dsec.isolation.buildns --base N [--cgroup DIR]... [--bind SRC:DST]... -- PROG ARGS`.

* a user namespace mapping ids 0..65535 to host ids N..N+65535 (a range no one else holds
  while it runs), so the builder and every RUN step it starts are unprivileged on the host:
  no host file that is not world-readable can be read, none can be written;
* a network namespace with nothing in it (not even loopback up): neither the builder nor a
  RUN step reaches any address, whatever the Dockerfile says (`RUN --network=host` too);
  base images are fetched before, under the pull policy (dsec.layers.pull);
* a mount namespace, private: every overlay the builder mounts vanishes with it, nothing
  is added to the host's mount table; `--bind` puts directories of ours over the builder's
  host paths (its caches under /var/cache); on hybrid cgroup hosts the v2 mount crun
  rejects is hidden, as dsec-shim does for sandboxes;
* the cgroups given (`--cgroup DIR`: a directory whose cgroup.procs takes this process
  before anything is started), where the caller set the memory, pids and cpu limits.

PROG is an absolute path: after the switch this process can no longer read its own
interpreter's files if they are private to root, so nothing is imported past that point.
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWIPC = 0x00020000, 0x10000000, 0x40000000, 0x08000000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
RANGE = 65536
_UNIFIED = b"/sys/fs/cgroup/unified"


def _child(libc: ctypes.CDLL, ready: int, go: int, binds: list[tuple[str, str]], argv: list[str]) -> None:
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC) != 0:
        os.write(2, b"buildns: unshare failed\n")
        os._exit(125)
    os.write(ready, b"u")
    if os.read(go, 1) != b"g":
        os._exit(125)
    os.setresgid(0, 0, 0)
    os.setgroups([])
    os.setresuid(0, 0, 0)
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        os.write(2, b"buildns: cannot make / private\n")
        os._exit(125)
    if os.path.exists(_UNIFIED + b"/cgroup.procs"):
        libc.mount(b"dsec-cg2", _UNIFIED, b"tmpfs", 0, b"size=64k")
    for src, dst in binds:
        if libc.mount(src.encode(), dst.encode(), None, MS_BIND, None) != 0:
            os.write(2, f"buildns: cannot bind {src} on {dst}\n".encode())
            os._exit(125)
    os.execv(argv[0], argv)


def main(args: list[str]) -> int:
    sep = args.index("--")
    opts, argv = args[:sep], args[sep + 1 :]
    base, cgroups, binds = -1, [], []
    for flag, value in zip(opts[::2], opts[1::2], strict=True):
        if flag == "--base":
            base = int(value)
        elif flag == "--cgroup":
            cgroups.append(value)
        elif flag == "--bind":
            src, _, dst = value.partition(":")
            binds.append((src, dst))
    if base < RANGE or not argv or not argv[0].startswith("/"):
        print("buildns: --base N (>= 65536) and an absolute program are required", file=sys.stderr)
        return 2
    for d in cgroups:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    libc = ctypes.CDLL(None, use_errno=True)
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r1)
        os.close(w2)
        _child(libc, w1, r2, binds, argv)
    os.close(w1)
    os.close(r2)
    if os.read(r1, 1) != b"u":
        return 125
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"0 {base} {RANGE}\n")
    os.write(w2, b"g")
    os.close(w2)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
