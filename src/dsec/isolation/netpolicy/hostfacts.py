"""Facts about the host: its addresses, routes, resolvers, sysctls, and the platform's
addresses that no rule may reach."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from dsec.isolation.netpolicy.limits import DNS_PORT
from dsec.models.network import DOMAIN_RE

log = logging.getLogger("dsec.netpolicy")

# --------------------------------------------------------------------------- host facts


def host_addresses(fib_trie: str = "/proc/net/fib_trie", *, broadcast: bool = False) -> set[str]:
    """Every IPv4 address local to this process's network namespace (the host's); with
    `broadcast`, also its subnets' broadcast addresses (the host delivers those to itself)."""
    out: set[str] = set()
    last = ""
    kinds = ("/32 host LOCAL", "/32 link BROADCAST") if broadcast else ("/32 host LOCAL",)
    with contextlib.suppress(OSError), open(fib_trie) as f:
        for line in f:
            s = line.strip()
            if s.startswith(("|--", "+--")):
                last = s.split()[1]
            elif s in kinds and last:
                out.add(last)
    return out


def parse_platform(values: Iterable[str]) -> tuple[list[str], list[str]]:
    """(IPv4 networks, host names) of a platform address list: IPs, CIDRs, host names or
    URLs (``https://api.example:8443/x`` -> ``api.example``). IPv6 entries are ignored
    (sandboxes have no IPv6)."""
    nets: list[str] = []
    names: list[str] = []
    for raw in values:
        for item in re.split(r"[\s,]+", raw.strip()):
            if not item:
                continue
            host = item
            if "://" in item:
                host = item.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
                if host.startswith("["):
                    continue  # an IPv6 literal
                host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
            try:
                net = ipaddress.ip_network(host, strict=False)
            except ValueError:
                if not DOMAIN_RE.match(host.lower().rstrip(".")):
                    raise ValueError(
                        f"platform address {item!r} is not an IP, a CIDR, a host name or a URL"
                    ) from None
                names.append(host.lower().rstrip("."))
                continue
            if net.version == 4:
                nets.append(str(net))
    return nets, names


def _resolve_names(names: Sequence[str]) -> list[str]:
    """Blocking: every IPv4 address of `names` (run in an executor)."""
    out: list[str] = []
    for name in names:
        with contextlib.suppress(OSError):
            for info in socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM):
                out.append(str(info[4][0]))
    return out


def _host_routes() -> list[tuple[str, ipaddress.IPv4Network]]:
    """(device, destination) of the host's IPv4 routes (main table)."""
    routes = []
    with contextlib.suppress(OSError), open("/proc/net/route") as f:
        next(f)
        for line in f:
            p = line.split()
            dest = ipaddress.IPv4Address(struct.pack("<I", int(p[1], 16)))
            mask = ipaddress.IPv4Address(struct.pack("<I", int(p[7], 16)))
            routes.append((p[0], ipaddress.IPv4Network(f"{dest}/{mask}", strict=False)))
    return routes


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def _read_sysctl(key: str) -> str:
    return _sysctl_path(key).read_text().strip()


def _write_sysctl(key: str, value: str) -> None:
    _sysctl_path(key).write_text(value)


def _resolv_conf_upstreams(path: str = "/etc/resolv.conf") -> list[tuple[str, int]]:
    out = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            p = line.split()
            if len(p) >= 2 and p[0] == "nameserver":
                out.append((p[1].split("%")[0], DNS_PORT))
    return out or [("127.0.0.1", DNS_PORT)]


def _collapse(nets: Iterable[str]) -> list[str]:
    v4 = [ipaddress.ip_network(n, strict=False) for n in nets]
    return [str(n) for n in ipaddress.collapse_addresses(n for n in v4 if n.version == 4)]
