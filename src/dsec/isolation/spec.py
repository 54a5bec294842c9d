"""The OCI runtime bundle config for a container sandbox.

Defaults are the isolation contract of a sandbox: a user namespace (root
inside is an unprivileged id range outside), private pid / mount / ipc / uts /
net / cgroup namespaces, loopback-only network, a minimal capability set, the
seccomp profile, masked and read-only kernel paths, no host mounts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsec.isolation.seccomp import oci_seccomp

UID_OFFSET = 100000
ID_RANGE = 65536

# Enough to be root in your own sandbox (install packages, chown, kill your
# own processes, bind low ports on loopback), nothing that reaches the kernel.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_NET_BIND_SERVICE",
]

MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/sysrq-trigger",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sys/kernel/core_pattern",
    "/proc/config.gz",
    "/sys/firmware",
    "/sys/kernel",
    "/sys/devices/virtual/powercap",
    "/sys/fs/selinux",
    # The shim (PID 1) is non-dumpable, but its /proc entries belong to the sandbox's root,
    # who could list its descriptors: nothing there for anyone inside.
    "/proc/1/fd",
    "/proc/1/fdinfo",
    "/proc/1/map_files",
]

READONLY_PATHS = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
]

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The platform's trusted tools (a static bash for sessions) as every sandbox sees them: a
# read-only, nosuid, nodev bind of a host directory the edge prepares. Nothing inside can
# replace them: the sandbox has no CAP_SYS_ADMIN and seccomp refuses mount and umount.
TOOLS_DIR = "/.dsec-tools"


@dataclass(frozen=True)
class Limits:
    cpu: float
    memory_mb: int
    pids: int


def _mount(destination: str, fs_type: str, source: str, *options: str) -> dict[str, Any]:
    """One entry of the OCI spec's mounts."""
    return {"destination": destination, "type": fs_type, "source": source, "options": list(options)}


def build_config(
    *,
    hostname: str,
    args: list[str],
    cgroups_path: str,
    limits: Limits,
    rootfs: str = "rootfs",
    uid_offset: int = UID_OFFSET,
    id_range: int = ID_RANGE,
    env: dict[str, str] | None = None,
    tools_dir: str | None = None,
) -> dict[str, Any]:
    period = 100_000
    memory = limits.memory_mb * 1024 * 1024
    process_env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", **(env or {})}
    tools = [_mount(TOOLS_DIR, "bind", tools_dir, "bind", "ro", "nosuid", "nodev")] if tools_dir else []
    return {
        "ociVersion": "1.0.2",
        "hostname": hostname,
        "root": {"path": rootfs, "readonly": False},
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": [f"{k}={v}" for k, v in process_env.items()],
            "cwd": "/",
            "noNewPrivileges": True,
            "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 16384, "soft": 16384}],
        },
        "mounts": [
            _mount("/proc", "proc", "proc", "nosuid", "noexec", "nodev"),
            _mount("/dev", "tmpfs", "tmpfs", "nosuid", "strictatime", "mode=755", "size=65536k"),
            _mount(
                "/dev/pts",
                "devpts",
                "devpts",
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ),
            _mount("/dev/shm", "tmpfs", "shm", "nosuid", "noexec", "nodev", "mode=1777", "size=65536k"),
            _mount("/dev/mqueue", "mqueue", "mqueue", "nosuid", "noexec", "nodev"),
            _mount("/sys", "sysfs", "sysfs", "nosuid", "noexec", "nodev", "ro"),
            *tools,
        ],
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": uid_offset, "size": id_range}],
            "gidMappings": [{"containerID": 0, "hostID": uid_offset, "size": id_range}],
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
            "cgroupsPath": cgroups_path,
            "resources": {
                "memory": {"limit": memory, "swap": memory},
                "cpu": {
                    "quota": max(1000, int(limits.cpu * period)),
                    "period": period,
                    "shares": max(2, int(limits.cpu * 1024)),
                },
                "pids": {"limit": limits.pids},
                "devices": [{"allow": False, "access": "rwm"}],
            },
            "seccomp": oci_seccomp(),
            "maskedPaths": MASKED_PATHS,
            "readonlyPaths": READONLY_PATHS,
            "rootfsPropagation": "private",
        },
    }
