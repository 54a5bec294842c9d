"""Per-sandbox network policy: an allowlist enforced by nftables, with DNS that keeps domain rules honest.

Default: nothing. A sandbox without a policy keeps its loopback-only network namespace
and this module never touches it (no veth, no rules, no cost).

Topology (one gateway per edge, created on the first policy, removed by ``close()``)::

    sandbox netns                 gw netns "dsec-gw-<edge>"                  host netns
    eth0 10.X.a.b/32  <-veth->   s<n>  10.X.0.1/32 (same address on every   dsu<tag> 10.X.255.253/30
      default via 10.X.0.1            sandbox link; DNS forwarder listens)      -> masquerade -> uplink
      table inet dsec (inner)    up0 10.X.255.254/30  <------ veth ------->
                                 table inet dsec (outer): per-sandbox chains,
                                 masquerade to up0

Why a gateway namespace instead of veths in the host's namespace: the host keeps one
link and one small nft table (``ip dsec-<edge>``: masquerade of one address, no new
connections into the gateway) however many sandboxes run; every per-sandbox link, route,
set and chain lives in a namespace the edge owns and deletes as a whole; and the host's
own firewall (iptables, docker) never interacts with per-sandbox rules. The gateway also
masquerades, so the host sees one source address and needs no route into sandbox space.
The host must forward between its uplink and ``dsu<tag>``: the edge enables IPv4
forwarding on those two devices only (never ``net.ipv4.ip_forward`` for all devices) and
restores the uplink's setting when the last gateway goes.

Enforcement happens twice, with the same compiled rule body:

* inner: table ``inet dsec`` in the sandbox's own network namespace (output and input
  hooks, policy drop). The sandbox's root cannot change it: the namespace is owned by
  the sandbox's user namespace, where its processes hold only ``spec.CAPABILITIES`` (no
  CAP_NET_ADMIN, no CAP_NET_RAW; the tests prove netlink and ioctl changes fail with
  EPERM). Denied packets are rejected locally (icmpx admin-prohibited), so a denied
  ``connect()`` fails at once (EHOSTUNREACH) instead of hanging.
* outer: table ``inet dsec`` in the gateway: ``iifname vmap`` dispatches to the
  sandbox's chain, which also drops spoofed source addresses. If the inner table were
  wrong or missing, the outer one still holds.

Rule order (both tables): loopback, established/related, the DNS forwarder, then
``never`` (the host's own addresses and its subnets' broadcast addresses, the dsec
supernet of every edge's sandboxes and gateways, loopback, link-local incl. cloud
metadata, multicast, broadcast, the platform's addresses on other hosts from
``platform=`` and ``$DSEC_PLATFORM_ADDRESSES`` (IPs, CIDRs, host names or URLs of
apiservers and edges), plus ``blocked``), then the allowlist: addresses and CIDRs, then
domain rules (``ip daddr @<set>``), then a counted drop. So no rule, not even an exact
/32, reaches the node, the edge, the apiserver, a gateway or another sandbox, and a domain
that resolves to such an address (DNS rebinding) does not either; :meth:`NetHost.check`
refuses a rule that can only name such addresses (HTTP 400 naming the address). Behind
both tables the host's own table drops everything from its gateways addressed to the host
itself (input hook), whatever address the host has now or gets later.

Shared pieces have per-sandbox shares (:class:`NetLimits`): live conntrack entries
(``ct count``) and new connections per second, in the sandbox's table and again in the
gateway keyed by the link; closed TCP connections leave the gateway's and the host's
tables after 10 s; the DNS forwarder's query rate, TCP connections and upstream lookups.
A source address that is not the link's own is dropped at the gateway (reverse path).

DNS: each gateway runs a forwarder (asyncio, UDP and TCP) on 10.X.0.1:53; its listening
sockets are made in the gateway namespace, its upstream sockets in the host's (so the
host's resolver, even a 127.0.0.53 stub, works). It knows a sandbox by the source address
of the query (spoofing is dropped by the outer chain), answers names outside the
sandbox's domain rules with NXDOMAIN (AAAA with no data: sandboxes are IPv4-only),
forwards the rest, and before replying adds every A record of the answer to the
matching rules' sets, inner and outer, with a timeout of the record's TTL (clamped, plus
grace). So a name resolved through the forwarder connects; an address that did not come
from an allowed name does not. The sandbox's ``/etc/resolv.conf`` must name the forwarder
(:meth:`NetHost.resolv_conf`); the edge writes it through its file API.

Updates are atomic and additive: an update loads the whole policy into a new chain
``g<n>`` (new domain sets only for new patterns, so learned addresses of patterns that
stay are kept) and inserts ``jump g<n>`` at the top of the base chain, in one
transaction; every generation ends in a verdict, so older ones are never reached. A
transaction that deletes anything waits for an RCU grace period in the kernel (~10-15 ms
measured here, against ~0.2 ms for additions), so shadowed chains and unused sets are
deleted afterwards by a second worker thread. Established connections continue
(conntrack); new ones follow the new policy.

Commands go through libnftables (ctypes) from a worker thread that enters the target
namespace with setns(2) for each call (a pidfd for sandboxes, so a reused pid is never
hit, and nothing pins the namespace) and returns to the host's. Measured: an update
~1.5 ms; the first policy of a sandbox ~5-8 ms (one ``ip -batch`` on each side of the
link; the first conntrack rule in a fresh namespace sometimes costs more); the gateway
~30-40 ms once per edge.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import hashlib
import ipaddress
import json
import logging
import os
import random
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dsec import errors
from dsec.models.network import DOMAIN_RE, NetRule, NetworkPolicy

log = logging.getLogger("dsec.netpolicy")

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
DNS_PORT = 53
DNS_MIN_TTL = 5  # an element shorter than this would expire before the client connects
DNS_MAX_TTL = 3600  # longer TTLs are rewritten down to this in the reply
DNS_GRACE_S = 10  # set timeout = TTL + grace: a client caches for at most TTL
DNS_UPSTREAM_TIMEOUT = 2.0
SANDBOX_IF = "eth0"
GW_UPLINK_IF = "up0"
DEFAULT_SUPERNET = "10.240.0.0/12"
# Never reachable by any rule (see NetHost.never(); a rule naming them is refused).
ALWAYS_BLOCKED = (
    "0.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",  # link-local, cloud metadata services
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, 255.255.255.255
)
_BLOCKED_WHY = {
    "0.0.0.0/8": "'this network'",
    "127.0.0.0/8": "loopback",
    "169.254.0.0/16": "link-local (cloud metadata services)",
    "224.0.0.0/4": "multicast",
    "240.0.0.0/4": "reserved or broadcast",
}
# Extra platform addresses (apiservers, edges, databases on other hosts): IPs, CIDRs, host
# names or URLs, separated by commas or spaces. Added to NetHost(platform=...).
PLATFORM_ENV = "DSEC_PLATFORM_ADDRESSES"
PLATFORM_RESOLVE_S = 60.0  # host names in the platform list are resolved again after this
NEVER_CACHE_S = 1.0  # the DNS path's view of the host's addresses is at most this old


@dataclass(frozen=True)
class NetLimits:
    """Per-sandbox shares of the per-edge pieces every sandbox with a policy uses.

    Conntrack (the gateway's table, and the host's, which every gateway's flows also pass):
    at most ``ct_open`` live entries per sandbox (nf_conncount counts every state but TCP
    TIME_WAIT/CLOSE), and at most ``ct_rate``/s new ones (burst ``ct_burst``), so closed
    connections, whose entries the count does not see, stay bounded too: they last
    ``ct_closed_timeout`` s (instead of 120) in both tables. Enforced in the sandbox's own
    table (a refused connect() fails at once) and again in the gateway, keyed by the link.

    DNS forwarder: ``dns_rate`` queries/s per sandbox (burst ``dns_burst``), UDP in the
    gateway's kernel (a flood never reaches the socket) and UDP+TCP in the forwarder; at
    most ``dns_tcp`` TCP connections per sandbox (kernel and forwarder), each closed after
    ``dns_tcp_idle`` s without a complete query or ``dns_tcp_queries`` queries; at most
    ``dns_inflight`` upstream lookups per sandbox at a time."""

    ct_open: int = 1024
    ct_rate: int = 100
    ct_burst: int = 1000
    ct_closed_timeout: int = 10
    host_ct_open: int = 65536  # every sandbox of the edge together, in the host's table
    dns_rate: int = 100
    dns_burst: int = 200
    dns_tcp: int = 4
    dns_tcp_total: int = 1024
    dns_tcp_idle: float = 2.0
    dns_tcp_queries: int = 100
    dns_inflight: int = 32


# --------------------------------------------------------------------------- syscalls, libnftables

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def setns(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """setns(2) for the calling thread only; `fd` may be a namespace file or a pidfd.
    (Looked up at call time.)"""
    if _libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


class NftError(RuntimeError):
    pass


class _LibNft:
    """The few libnftables calls we need: run a script (one transaction), get its output."""

    NFT_CTX_OUTPUT_JSON = 1 << 4

    def __init__(self) -> None:
        name = ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as e:
            raise NftError("libnftables is missing: install the apt package nftables") from e
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        for f in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
        for f in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, f).argtypes = [ctypes.c_void_p]
            getattr(lib, f).restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self.lib = lib

    def run(self, script: str, *, json_output: bool = False) -> str:
        """Run `script` in the calling thread's network namespace (the context's netlink
        socket is opened here, so a context is made per call)."""
        lib = self.lib
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise NftError("nft_ctx_new failed")
        try:
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            if json_output:
                lib.nft_ctx_output_set_flags(ctx, self.NFT_CTX_OUTPUT_JSON)
            rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
            if rc != 0:
                err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
                raise NftError(err.strip() or f"nft failed ({rc})")
            return out
        finally:
            lib.nft_ctx_free(ctx)


class NetnsWorker:
    """One thread that runs calls inside other network namespaces, one at a time.

    setns(2) changes only the calling thread, so the event loop's thread never moves;
    this thread enters the target (a namespace file or a pidfd) per call and always goes
    back to the namespace it started in."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsec-netns")
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._nft: _LibNft | None = None

    def _enter(self, ns_fd: int | None, fn: Callable[[], T]) -> T:
        if ns_fd is None:
            return fn()
        setns(ns_fd)
        try:
            return fn()
        finally:
            try:
                setns(self._home)
            except OSError:  # never run another call in a foreign namespace
                log.critical("could not return the netns worker to the host namespace")
                os._exit(70)

    async def call(self, ns_fd: int | None, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._enter, ns_fd, fn)

    async def nft(self, ns_fd: int | None, script: str, *, json_output: bool = False) -> str:
        if self._nft is None:
            self._nft = _LibNft()
        nft = self._nft
        return await self.call(ns_fd, lambda: nft.run(script, json_output=json_output))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._home >= 0:
            os.close(self._home)
            self._home = -1


def socket_in_netns(ns_path: str, family: int, kind: int) -> socket.socket:
    """A socket that belongs to another network namespace (a socket keeps the namespace
    it was made in, whichever thread uses it later)."""
    box: list[socket.socket] = []
    errs: list[BaseException] = []

    def make() -> None:
        try:
            fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns(fd)
            finally:
                os.close(fd)
            box.append(socket.socket(family, kind))
        except BaseException as e:
            errs.append(e)

    t = threading.Thread(target=make, name="dsec-netns-socket")  # the thread dies in that netns
    t.start()
    t.join()
    if errs:
        raise errs[0]
    return box[0]


async def run_tool(argv: Sequence[str], stdin: str = "") -> tuple[int, str]:
    """Run a helper (posix_spawn + pidfd, like the container backend) feeding `stdin`;
    (exit code, stderr+stdout)."""
    rfd, wfd = os.pipe()
    ofd, efd = os.pipe()
    try:
        os.write(wfd, stdin.encode())  # small scripts: they fit in the pipe buffer
        os.close(wfd)
        wfd = -1
        pid = os.posix_spawnp(
            argv[0],
            list(argv),
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, rfd, 0),
                (os.POSIX_SPAWN_DUP2, efd, 1),
                (os.POSIX_SPAWN_DUP2, efd, 2),
            ],
        )
        os.close(efd)
        efd = -1
        pidfd = os.pidfd_open(pid)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        loop.add_reader(pidfd, _resolve_once, done)
        try:
            await done
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out = b""
        while select.select([ofd], [], [], 0)[0]:
            chunk = os.read(ofd, 65536)
            if not chunk:
                break
            out += chunk
        return rc, out.decode(errors="replace").strip()
    finally:
        for fd in (rfd, wfd, ofd, efd):
            if fd >= 0:
                os.close(fd)


def _resolve_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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


# --------------------------------------------------------------------------- rule compilation


def _set_suffix(pattern: str) -> str:
    return "d_" + hashlib.sha1(pattern.encode()).hexdigest()[:12]


def never_set_name(never: Sequence[str]) -> str:
    """Content-addressed: a new host address makes a new set, swapped in like a rule."""
    return "never_" + hashlib.sha1(",".join(never).encode()).hexdigest()[:12]


def _l4_matches(rule: NetRule) -> list[str]:
    """nft match expressions for the rule's protocols and ports (one per rule line)."""
    out = []
    l4 = [p for p in rule.protocols if p != "icmp"]
    if l4:
        protos = l4[0] if len(l4) == 1 else "{ " + ", ".join(l4) + " }"
        expr = f"meta l4proto {protos}"
        if rule.ports:
            expr += " th dport { " + ", ".join(str(p) for p in rule.ports) + " }"
        out.append(expr)
    if "icmp" in rule.protocols:
        out.append("meta l4proto icmp")
    return out


def compile_body(policy: NetworkPolicy, *, prefix: str, never: str, deny: str) -> list[str]:
    """The rule lines shared by the inner and the outer chain (see the module docstring);
    `deny` is the terminal verdict statement (with its counter). The platform's addresses
    are dropped before any allow rule: no rule, exact or broad, reaches them."""
    ips = [r for r in policy.allow if not r.is_domain]
    dom = [r for r in policy.allow if r.is_domain]
    lines = [f"ip daddr @{prefix}{never} {deny}"]
    lines += [f"ip daddr {r.to} {m} accept" for r in ips for m in _l4_matches(r)]
    lines += [f"ip daddr @{prefix}{_set_suffix(r.to)} {m} accept" for r in dom for m in _l4_matches(r)]
    lines.append(deny)
    return lines


def domain_sets(policy: NetworkPolicy) -> set[str]:
    return {_set_suffix(r.to) for r in policy.allow if r.is_domain}


@dataclass
class RuleState:
    """What one table holds for one sandbox: its generation chains and its sets
    (names without the table's prefix)."""

    gen: int = 0
    old_gens: list[int] = field(default_factory=list)
    sets: set[str] = field(default_factory=set)

    def wanted(self, policy: NetworkPolicy, never: Sequence[str]) -> set[str]:
        return domain_sets(policy) | {never_set_name(never)}


# How the two tables differ: where the generation chains are jumped from, what comes
# before the body, and the deny statement.
INNER_TABLE = "inet dsec"
INNER_DENY = 'counter name "denied" reject with icmpx admin-prohibited'  # connect() fails at once


def inner_base_script(*, gw_ip: str, limits: NetLimits) -> str:
    """Created once per sandbox: only additions, so it is as fast as a rule load. The
    ``limits`` chain is never flushed (its counts survive policy updates)."""
    t = INNER_TABLE
    lim = 'counter name "limited" reject with icmpx admin-prohibited'
    return (
        "\n".join(
            [
                f"add table {t}",
                f"add counter {t} denied",
                f"add counter {t} limited",
                f"add chain {t} limits {{ type filter hook output priority filter - 1; }}",
                f'add rule {t} limits oif "lo" accept',
                f"add rule {t} limits ip daddr {gw_ip} meta l4proto {{ tcp, udp }} "
                f"th dport {DNS_PORT} accept",
                f"add rule {t} limits ct state new ct count over {limits.ct_open} {lim}",
                f"add rule {t} limits ct state new limit rate over {limits.ct_rate}/second "
                f"burst {limits.ct_burst} packets {lim}",
                f"add chain {t} output {{ type filter hook output priority filter; policy drop; }}",
                f"add chain {t} input {{ type filter hook input priority filter; policy drop; }}",
                f'add rule {t} input iif "lo" accept',
                f"add rule {t} input ct state established,related accept",
            ]
        )
        + "\n"
    )


def _ct_timeout(table: str, limits: NetLimits) -> str:
    """A conntrack timeout policy: closed TCP connections (which nf_conncount does not
    count) leave the table after ct_closed_timeout s; every other state keeps the default."""
    c = limits.ct_closed_timeout
    return (
        f"add ct timeout {table} closed {{ protocol tcp; l3proto ip; "
        f"policy = {{ time_wait: {c}, close: {c} }}; }}"
    )


def generation_script(
    policy: NetworkPolicy,
    state: RuleState,
    never: Sequence[str],
    *,
    table: str,
    prefix: str,
    base_chain: str,
    head: Sequence[str],
    deny: str,
) -> str:
    """One additive transaction: new sets (if any), a new chain ``<prefix>g<n>`` with the
    whole policy, and a jump to it inserted at the top of `base_chain`, where it shadows
    the older generations (each ends in a verdict). Deleting anything makes nftables
    commit wait for an RCU grace period (~15 ms here), so deletions are left to gc_script."""
    never_name = never_set_name(never)
    gen = state.gen + 1
    chain = f"{prefix}g{gen}"
    s = []
    if never_name not in state.sets:
        s.append(f"add set {table} {prefix}{never_name} {{ type ipv4_addr; flags interval; }}")
        if never:
            s.append(f"add element {table} {prefix}{never_name} {{ {', '.join(never)} }}")
    for name in sorted(domain_sets(policy) - state.sets):
        s.append(f"add set {table} {prefix}{name} {{ type ipv4_addr; flags timeout; }}")
    s.append(f"add chain {table} {chain}")
    body = [*head, *compile_body(policy, prefix=prefix, never=never_name, deny=deny)]
    s += [f"add rule {table} {chain} {line}" for line in body]
    s.append(f"insert rule {table} {base_chain} jump {chain}")
    return "\n".join(s) + "\n"


def gc_script(state: RuleState, wanted: set[str], *, table: str, prefix: str, base_chain: str) -> str:
    """Drop what a generation switch shadowed: old jumps, chains and unused sets."""
    s = [f"flush chain {table} {base_chain}", f"add rule {table} {base_chain} jump {prefix}g{state.gen}"]
    for g in state.old_gens:
        s += [f"flush chain {table} {prefix}g{g}", f"delete chain {table} {prefix}g{g}"]
    s += [f"delete set {table} {prefix}{n}" for n in sorted(state.sets - wanted)]
    return "\n".join(s) + "\n"


def gw_sandbox_base_script(*, chain: str, ifname: str) -> str:
    t = INNER_TABLE
    return (
        f"add chain {t} {chain}\nadd counter {t} {chain}_denied\n"
        f'add element {t} sbs {{ "{ifname}" : jump {chain} }}\n'
    )


GW_LIMIT_SETS = ("ct_open", "ct_rate", "dns_rate", "dns_conn")  # keyed by the sandbox's link


def gw_forget_limits_script(*, ifname: str) -> list[str]:
    """One command per set (a missing element would fail a whole transaction): a reused
    link name starts with clean counts."""
    return [f'delete element {INNER_TABLE} {name} {{ "{ifname}" }}\n' for name in GW_LIMIT_SETS]


def gw_remove_script(*, chain: str, ifname: str, state: RuleState) -> str:
    t = INNER_TABLE
    s = [f'delete element {t} sbs {{ "{ifname}" }}', f"flush chain {t} {chain}", f"delete chain {t} {chain}"]
    for g in [*state.old_gens, state.gen]:
        if g:
            s += [f"flush chain {t} {chain}_g{g}", f"delete chain {t} {chain}_g{g}"]
    s += [f"delete set {t} {chain}_{n}" for n in sorted(state.sets)]
    s.append(f"delete counter {t} {chain}_denied")
    return "\n".join(s) + "\n"


def gw_base_script(*, gw_ip: str, limits: NetLimits) -> str:
    """The gateway's table. Before any per-sandbox chain: a source address that is not the
    link's own is dropped (reverse path; this covers the DNS forwarder too, which the
    per-sandbox chains do not see), and each link's share of conntrack and of the DNS
    forwarder is enforced, keyed by the link (which nothing inside can forge). DNS over UDP
    is not tracked at all (no conntrack entry per query)."""
    t = "inet dsec"
    lim = 'counter name "limited" reject with icmpx admin-prohibited'
    dns = f'iifname "s*" ip daddr {gw_ip}'
    s = [
        f"add table {t}",
        f"add map {t} sbs {{ type ifname : verdict; }}",
        f"add counter {t} limited",
        f"add counter {t} spoofed",
        _ct_timeout(t, limits),
        f"add set {t} ct_open {{ type ifname; size 65535; flags dynamic; }}",
        f"add set {t} ct_rate {{ type ifname; size 65535; flags dynamic,timeout; timeout 1m; }}",
        f"add set {t} dns_rate {{ type ifname; size 65535; flags dynamic,timeout; timeout 1m; }}",
        f"add set {t} dns_conn {{ type ifname; size 65535; flags dynamic; }}",
        f"add chain {t} raw {{ type filter hook prerouting priority raw; }}",
        f"add chain {t} raw_out {{ type filter hook output priority raw; }}",
        f"add chain {t} pre {{ type filter hook prerouting priority mangle; }}",
        f"add chain {t} forward {{ type filter hook forward priority filter; policy drop; }}",
        f"add chain {t} input {{ type filter hook input priority filter; policy drop; }}",
        f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; }}",
        *(f"flush chain {t} {c}" for c in ("raw", "raw_out", "pre", "forward", "input", "postrouting")),
        f'add rule {t} raw iifname "s*" fib saddr . iif oif missing counter name "spoofed" drop',
        f"add rule {t} raw {dns} udp dport {DNS_PORT} notrack",
        f"add rule {t} raw_out ip saddr {gw_ip} udp sport {DNS_PORT} notrack",
        f'add rule {t} pre iifname "s*" ct state new ct timeout set "closed"',
        f"add rule {t} forward ct state established,related accept",
        f'add rule {t} forward iifname "s*" ct state new add @ct_open '
        f"{{ iifname ct count over {limits.ct_open} }} {lim}",
        f'add rule {t} forward iifname "s*" ct state new update @ct_rate {{ iifname limit rate over '
        f"{limits.ct_rate}/second burst {limits.ct_burst} packets }} {lim}",
        f"add rule {t} forward iifname vmap @sbs",
        f'add rule {t} input iif "lo" accept',
        f"add rule {t} input ct state established,related accept",
        f"add rule {t} input {dns} udp dport {DNS_PORT} update @dns_rate {{ iifname limit rate over "
        f'{limits.dns_rate}/second burst {limits.dns_burst} packets }} counter name "limited" drop',
        f"add rule {t} input {dns} udp dport {DNS_PORT} accept",
        f"add rule {t} input {dns} tcp dport {DNS_PORT} ct state new add @dns_conn {{ iifname ct count over "
        f'{limits.dns_tcp} }} counter name "limited" reject with tcp reset',
        f"add rule {t} input {dns} tcp dport {DNS_PORT} accept",
        f'add rule {t} postrouting oifname "{GW_UPLINK_IF}" masquerade',
    ]
    return "\n".join(s) + "\n"


def host_script(*, table: str, host_if: str, gw_uplink_ip: str, limits: NetLimits) -> str:
    """The host's table for one edge. Nothing from the gateway is ever delivered to the
    host itself (input): whatever address the host has, now or later, and whatever the
    rules say. Flows from the gateway get the short timeout for closed connections, and
    the edge's sandboxes together hold at most host_ct_open entries of the host's table."""
    t = f"ip {table}"
    return (
        "\n".join(
            [
                f"add table {t}",
                _ct_timeout(t, limits),
                f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; }}",
                f"add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}",
                f"add chain {t} input {{ type filter hook input priority filter - 10; policy accept; }}",
                f"add chain {t} pre {{ type filter hook prerouting priority mangle; }}",
                f"flush chain {t} postrouting",
                f"flush chain {t} forward",
                f"flush chain {t} input",
                f"flush chain {t} pre",
                f'add rule {t} input iifname "{host_if}" counter drop',
                f'add rule {t} pre iifname "{host_if}" ct state new ct timeout set "closed"',
                f'add rule {t} postrouting ip saddr {gw_uplink_ip} oifname != "{host_if}" masquerade',
                f'add rule {t} forward oifname "{host_if}" ct state established,related accept',
                f'add rule {t} forward oifname "{host_if}" counter drop',  # nothing starts a flow inwards
                f'add rule {t} forward iifname "{host_if}" ct state new ct count over {limits.host_ct_open} '
                "counter reject with icmp type admin-prohibited",
            ]
        )
        + "\n"
    )


def add_addresses_script(table: str, sets: Iterable[str], addrs: Sequence[tuple[str, int]]) -> str:
    """Add learned addresses, or restart their timeout: ``expires`` on an existing element
    updates it (Linux >= 6.10; older kernels keep the first expiry)."""
    elems = ", ".join(f"{a} timeout {t}s expires {t}s" for a, t in addrs)
    return "".join(f"add element {table} {name} {{ {elems} }}\n" for name in sets)


# --------------------------------------------------------------------------- DNS messages


class DnsError(ValueError):
    pass


def _skip_name(msg: bytes | bytearray, off: int) -> int:
    while True:
        if off >= len(msg):
            raise DnsError("truncated name")
        n = msg[off]
        if n == 0:
            return off + 1
        if n & 0xC0 == 0xC0:
            return off + 2
        if n & 0xC0:
            raise DnsError("bad label")
        off += 1 + n


def _read_qname(msg: bytes, off: int) -> tuple[str, int]:
    """The question's name (no compression is legal there) and the offset after it."""
    labels = []
    while True:
        if off >= len(msg):
            raise DnsError("truncated name")
        n = msg[off]
        off += 1
        if n == 0:
            break
        if n & 0xC0 or off + n > len(msg):
            raise DnsError("bad question name")
        labels.append(msg[off : off + n].decode("ascii", errors="replace").lower())
        off += n
    return ".".join(labels), off


def parse_query(msg: bytes) -> tuple[int, str, int, int]:
    """(id, qname, qtype, end of the question) of a one-question query."""
    if len(msg) < 12:
        raise DnsError("short message")
    ident, flags, qd = struct.unpack_from("!HHH", msg)
    if flags & 0x8000 or qd != 1:
        raise DnsError("not a one-question query")
    name, off = _read_qname(msg, 12)
    if off + 4 > len(msg):
        raise DnsError("truncated question")
    qtype = struct.unpack_from("!H", msg, off)[0]
    return ident, name, qtype, off + 4


def reply_without_answer(query: bytes, qend: int, rcode: int) -> bytes:
    """A reply with the query's question and no records (NXDOMAIN=3, NOERROR=0 for no data,
    SERVFAIL=2, REFUSED=5)."""
    ident, flags = struct.unpack_from("!HH", query)
    flags = 0x8000 | (flags & 0x7900) | 0x0080 | rcode  # QR, opcode+RD kept, RA
    return struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + query[12:qend]


def a_records(msg: bytearray, *, max_ttl: int = DNS_MAX_TTL) -> list[tuple[str, int]]:
    """(address, ttl) of every A record in the answer section; TTLs above `max_ttl` are
    rewritten in place so no client caches longer than the sets remember."""
    if len(msg) < 12:
        raise DnsError("short message")
    qd, an = struct.unpack_from("!HH", msg, 4)
    off = 12
    for _ in range(qd):
        off = _skip_name(msg, off) + 4
    out = []
    for _ in range(an):
        off = _skip_name(msg, off)
        if off + 10 > len(msg):
            raise DnsError("truncated record")
        rtype, rclass, ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
        if ttl > max_ttl:
            struct.pack_into("!I", msg, off + 4, max_ttl)
            ttl = max_ttl
        rdata = off + 10
        if rdata + rdlen > len(msg):
            raise DnsError("truncated rdata")
        if rtype == 1 and rclass == 1 and rdlen == 4:
            out.append((socket.inet_ntoa(bytes(msg[rdata : rdata + 4])), ttl))
        off = rdata + rdlen
    return out


# --------------------------------------------------------------------------- the gateway


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def wait_s(self) -> float:
        """How long until take() succeeds."""
        return max(0.0, (1 - self.tokens) / self.rate)


@dataclass
class SandboxNet:
    """What the edge holds for one sandbox with a policy."""

    id: str
    pid: int
    pidfd: int
    index: int
    ip: str
    policy: NetworkPolicy
    inner: RuleState = field(default_factory=RuleState)  # in the sandbox's table
    outer: RuleState = field(default_factory=RuleState)  # in the gateway's table
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    gc: asyncio.Task[None] | None = None
    dns: dict[str, int] = field(
        default_factory=lambda: {"dns_allowed": 0, "dns_denied": 0, "dns_limited": 0, "dns_platform": 0}
    )
    last_inner: tuple[int, int] = (0, 0)
    last_limited: tuple[int, int] = (0, 0)
    dns_bucket: TokenBucket = field(default_factory=lambda: TokenBucket(1, 1))
    dns_tcp: int = 0  # open TCP connections to the forwarder
    dns_inflight: int = 0  # upstream lookups in flight

    @property
    def ifname(self) -> str:
        return f"s{self.index}"

    @property
    def chain(self) -> str:
        return f"sb{self.index}"

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]


class NetHost:
    """Per-edge network policy: the gateway, its DNS forwarder, per-sandbox rules.

    ``apply()`` / ``remove()`` per sandbox, ``counters()`` for telemetry, ``close()`` at
    edge shutdown. Nothing is created before the first ``apply()``."""

    def __init__(
        self,
        edge_name: str,
        *,
        supernet: str = DEFAULT_SUPERNET,
        subnet: str | None = None,
        upstreams: Sequence[tuple[str, int]] | None = None,
        blocked: Sequence[str] = (),
        platform: Sequence[str] | None = None,
        limits: NetLimits | None = None,
    ) -> None:
        self.edge = edge_name
        tag = hashlib.sha1(edge_name.encode()).hexdigest()[:8]
        self.gw_netns = f"dsec-gw-{edge_name}"[:64]
        self.host_if = f"dsu{tag}"
        self.host_table = "dsec-" + re.sub(r"[^A-Za-z0-9_.-]", "_", edge_name)
        self.supernet = ipaddress.IPv4Network(supernet)
        self._subnet_choice = subnet
        self.subnet: ipaddress.IPv4Network | None = None
        self.upstreams = list(upstreams) if upstreams else _resolv_conf_upstreams()
        self.blocked = list(blocked)
        # The platform's own addresses elsewhere (apiservers, other edges): given, and from
        # the environment. Names are resolved off the event loop (see _refresh_platform).
        extra = [*(platform or ()), os.environ.get(PLATFORM_ENV, "")]
        self._platform_nets, self._platform_names = parse_platform(extra)
        self._platform_resolved: list[str] = []
        self._platform_stamp = -PLATFORM_RESOLVE_S
        self._never_cache: tuple[float, list[ipaddress.IPv4Network]] = (-NEVER_CACHE_S, [])
        self.limits = limits or NetLimits()
        self.sandboxes: dict[str, SandboxNet] = {}
        self._by_ip: dict[str, SandboxNet] = {}
        self._free: list[int] = []
        self._next_index = 0
        self._worker = NetnsWorker()  # rule loads and DNS answers
        self._gc_worker = NetnsWorker()  # deletions (slow commits) never delay those
        self._gw_fd = -1
        self._ready = False
        self._gw_lock = asyncio.Lock()
        self._changed_sysctls: dict[str, str] = {}
        self._dns: DnsForwarder | None = None

    # --- addresses -------------------------------------------------------------------

    @property
    def gw_ip(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def _uplink_ips(self) -> tuple[str, str]:
        assert self.subnet is not None
        last = self.subnet.broadcast_address
        return str(last - 2), str(last - 1)  # host end, gateway end of a /30

    def _sandbox_ip(self, index: int) -> str:
        assert self.subnet is not None
        ip = self.subnet.network_address + 2 + index
        if ip >= self.subnet.broadcast_address - 3:
            raise RuntimeError(f"edge {self.edge} has no sandbox address left in {self.subnet}")
        return str(ip)

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        if self._subnet_choice:
            return ipaddress.IPv4Network(self._subnet_choice)
        subnets = list(self.supernet.subnets(new_prefix=max(16, self.supernet.prefixlen)))
        used = [net for dev, net in _host_routes() if net.prefixlen > 0 and dev != self.host_if]
        start = int(hashlib.sha1(self.edge.encode()).hexdigest(), 16) % len(subnets)
        for i in range(len(subnets)):
            cand = subnets[(start + i) % len(subnets)]
            if not any(cand.overlaps(u) for u in used):
                return cand
        raise RuntimeError(f"no free /16 for sandbox networks in {self.supernet}")

    def never(self) -> list[str]:
        """What no rule reaches (see the module docstring): reserved ranges, every edge's
        sandbox and gateway addresses, the host's addresses and broadcasts, the platform's
        addresses elsewhere and ``blocked``."""
        own = [str(self.subnet)] if self.subnet is not None else []
        return _collapse(
            [
                *ALWAYS_BLOCKED,
                str(self.supernet),
                *own,
                *host_addresses(broadcast=True),
                *self._platform_nets,
                *self._platform_resolved,
                *self.blocked,
            ]
        )

    def _never_nets(self) -> list[ipaddress.IPv4Network]:
        """never() as networks, at most NEVER_CACHE_S old (the DNS path asks per answer)."""
        stamp, nets = self._never_cache
        now = time.monotonic()
        if now - stamp >= NEVER_CACHE_S:
            nets = [ipaddress.IPv4Network(n) for n in self.never()]
            self._never_cache = (now, nets)
        return nets

    def is_platform(self, address: str) -> bool:
        ip = ipaddress.IPv4Address(address)
        return any(ip in n for n in self._never_nets())

    async def _refresh_platform(self) -> None:
        """Resolve the platform's host names (blocking: in an executor) every PLATFORM_RESOLVE_S."""
        if not self._platform_names or time.monotonic() - self._platform_stamp < PLATFORM_RESOLVE_S:
            return
        loop = asyncio.get_running_loop()
        resolved = await loop.run_in_executor(None, _resolve_names, self._platform_names)
        self._platform_stamp = time.monotonic()
        if resolved or not self._platform_resolved:  # a resolver outage keeps the last answer
            self._platform_resolved = sorted(set(resolved))
        self._never_cache = (-NEVER_CACHE_S, [])

    def _why_never(self, net: ipaddress.IPv4Network, host: Iterable[str]) -> str | None:
        """Why a rule's address or network lies wholly inside what no rule reaches."""

        def inside(items: Iterable[str]) -> bool:
            return any(net.subnet_of(ipaddress.IPv4Network(i, strict=False)) for i in items)

        for block, why in _BLOCKED_WHY.items():
            if inside([block]):
                return why
        if inside([str(self.supernet)] + ([str(self.subnet)] if self.subnet is not None else [])):
            return "the platform's sandbox and gateway network"
        if inside(host):
            return "an address of the host"
        if inside([*self._platform_nets, *self._platform_resolved]):
            return f"a platform address ({PLATFORM_ENV})"
        if inside(self.blocked):
            return "blocked on this edge"
        return None

    async def check(self, policy: NetworkPolicy) -> None:
        """Refuse a policy with a rule that can only reach the platform (an address of the
        host, of a gateway, an apiserver, another sandbox, loopback, link-local...): such a
        rule is never honoured, so the caller is told which address to remove. Broader
        rules are accepted; the platform's addresses inside them stay unreachable."""
        await self._refresh_platform()
        host: list[str] | None = None
        for rule in policy.allow:
            if rule.is_domain:
                continue
            if host is None:
                host = sorted(host_addresses(broadcast=True))
            why = self._why_never(ipaddress.IPv4Network(rule.to), host)
            if why is not None:
                raise errors.InvalidRequest(
                    f"network rule to {rule.to}: {rule.to} is {why}; sandboxes can never reach the "
                    "platform's addresses, whatever the policy says; remove this rule",
                    address=rule.to,
                )

    def resolv_conf(self) -> str:
        """The /etc/resolv.conf a sandbox with a policy needs."""
        if self.subnet is None:
            raise RuntimeError("no policy has been applied on this edge yet")
        return (
            "# dsec: the edge's DNS forwarder (answers the sandbox's allowed names only)\n"
            f"nameserver {self.gw_ip}\noptions attempts:2 timeout:2\n"
        )

    # --- the gateway -------------------------------------------------------------------

    async def _ip(self, argv: Sequence[str], batch: str = "") -> None:
        rc, out = await run_tool(argv, batch)
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {out}")

    async def remove_leftovers(self) -> None:
        """A previous edge process of this name may have left its gateway (crash, or
        close(keep=True)): remove it. The first apply() does this; an edge may call it at
        start too. apply() rebuilds the link of every sandbox it is given again."""
        if os.path.exists(f"/run/netns/{self.gw_netns}"):
            await run_tool(["ip", "netns", "del", self.gw_netns])
        if os.path.exists(f"/sys/class/net/{self.host_if}"):
            await run_tool(["ip", "link", "del", self.host_if])
        with contextlib.suppress(NftError):  # also: no libnftables, so nothing of ours either
            if f"table ip {self.host_table}\n" in await self._worker.nft(None, "list tables ip\n"):
                await self._worker.nft(None, f"delete table ip {self.host_table}\n")

    async def ensure_gateway(self) -> None:
        if self._ready:
            return
        async with self._gw_lock:
            if self._ready:
                return
            t0 = time.perf_counter()
            await self.remove_leftovers()
            self.subnet = self._pick_subnet()
            host_ip, gw_up_ip = self._uplink_ips()
            try:
                await self._ip(["ip", "netns", "add", self.gw_netns])
                self._gw_fd = os.open(f"/run/netns/{self.gw_netns}", os.O_RDONLY | os.O_CLOEXEC)
                await self._worker.call(self._gw_fd, _gateway_sysctls)
                await self._ip(
                    ["ip", "-batch", "-"],
                    f"link add {self.host_if} type veth peer name {GW_UPLINK_IF} netns {self.gw_netns}\n"
                    f"addr add {host_ip}/30 dev {self.host_if}\n"
                    f"link set {self.host_if} up\n",
                )
                await self._ip(
                    ["ip", "-n", self.gw_netns, "-batch", "-"],
                    f"link set lo up\naddr add {self.gw_ip}/32 dev lo\n"
                    f"addr add {gw_up_ip}/30 dev {GW_UPLINK_IF}\n"
                    f"link set {GW_UPLINK_IF} up\nroute add default via {host_ip}\n",
                )
                self._enable_host_forwarding()
                await self._worker.nft(
                    None,
                    host_script(
                        table=self.host_table, host_if=self.host_if, gw_uplink_ip=gw_up_ip, limits=self.limits
                    ),
                )
                await self._worker.nft(self._gw_fd, gw_base_script(gw_ip=self.gw_ip, limits=self.limits))
                self._dns = DnsForwarder(self, self.upstreams, self.limits)
                await self._dns.start(f"/run/netns/{self.gw_netns}", self.gw_ip)
            except BaseException:
                await self._destroy_gateway()
                raise
            self._ready = True
            ms = (time.perf_counter() - t0) * 1e3
            log.info("network gateway %s up in %.1f ms (%s)", self.gw_netns, ms, self.subnet)

    def _enable_host_forwarding(self) -> None:
        """IPv4 forwarding is decided by the input device: our link (egress) and the
        devices of the host's default routes (replies after un-NAT). Only those."""
        devs = {self.host_if} | {dev for dev, net in _host_routes() if net.prefixlen == 0}
        for dev in sorted(devs):
            key = f"net.ipv4.conf.{dev}.forwarding"
            with contextlib.suppress(OSError):
                old = _read_sysctl(key)
                if old != "1":
                    _write_sysctl(key, "1")
                    if dev != self.host_if:
                        self._changed_sysctls[key] = old

    def _restore_host_forwarding(self) -> None:
        others = (
            [n for n in os.listdir("/run/netns") if n.startswith("dsec-gw-")]
            if os.path.isdir("/run/netns")
            else []
        )
        if others:  # another edge's gateway still forwards through these devices
            return
        for key, old in self._changed_sysctls.items():
            with contextlib.suppress(OSError):
                _write_sysctl(key, old)
        self._changed_sysctls.clear()

    async def _destroy_gateway(self) -> None:
        if self._dns is not None:
            self._dns.close()
            self._dns = None
        if self._gw_fd >= 0:
            os.close(self._gw_fd)
            self._gw_fd = -1
        await run_tool(["ip", "netns", "del", self.gw_netns])  # its links and their peers go with it
        await run_tool(["ip", "link", "del", self.host_if])
        with contextlib.suppress(NftError):
            await self._worker.nft(None, f"delete table ip {self.host_table}\n")
        self._restore_host_forwarding()
        self._ready = False

    # --- per sandbox ---------------------------------------------------------------------

    async def apply(
        self, sandbox_id: str, pid: int, policy: NetworkPolicy, *, check: bool = True
    ) -> dict[str, float]:
        """Give a running sandbox `policy` (the first call links it to the gateway; later
        calls replace its rules atomically). Returns timings in ms. `check`: refuse a rule
        that names the platform (see check(); False when re-applying a stored policy: the
        rules drop those addresses anyway)."""
        t0 = time.perf_counter()
        await self.ensure_gateway()
        if check:
            await self.check(policy)
        else:
            await self._refresh_platform()
        t1 = time.perf_counter()
        sb = self.sandboxes.get(sandbox_id)
        created = sb is None
        if sb is None:
            pidfd = os.pidfd_open(pid)
            index = self._free.pop() if self._free else self._next_index
            if index == self._next_index:
                self._next_index += 1
            try:
                sb = SandboxNet(sandbox_id, pid, pidfd, index, self._sandbox_ip(index), policy)
                sb.dns_bucket = TokenBucket(self.limits.dns_rate, self.limits.dns_burst)
            except BaseException:
                os.close(pidfd)
                self._free.append(index)
                raise
            self.sandboxes[sandbox_id] = sb
            self._by_ip[sb.ip] = sb
        async with sb.lock:
            try:
                if created:  # rules before the link: there is no moment without them
                    await self._create_tables(sb)
                await self._load_rules(sb, policy)
                t2 = time.perf_counter()
                if created:
                    await self._link(sb)
            except BaseException:
                if created:
                    await self._forget(sb)
                raise
        if sb.inner.old_gens or sb.outer.old_gens:
            sb.gc = asyncio.ensure_future(self._collect(sb))
        t3 = time.perf_counter()
        return {"gateway": (t1 - t0) * 1e3, "rules": (t2 - t1) * 1e3, "link": (t3 - t2) * 1e3}

    async def _create_tables(self, sb: SandboxNet) -> None:
        tables = await self._worker.nft(sb.pidfd, "list tables\n")
        if f"table {INNER_TABLE}" in tables:  # an edge before a restart made it: start over
            await self._worker.nft(sb.pidfd, f"delete table {INNER_TABLE}\n")
        await self._worker.nft(sb.pidfd, inner_base_script(gw_ip=self.gw_ip, limits=self.limits))
        await self._worker.nft(self._gw_fd, gw_sandbox_base_script(chain=sb.chain, ifname=sb.ifname))

    async def _load_rules(self, sb: SandboxNet, policy: NetworkPolicy) -> None:
        never = self.never()
        dns = f"ip daddr {self.gw_ip} meta l4proto {{ tcp, udp }} th dport {DNS_PORT} accept"
        head = ['oif "lo" accept', "ct state established,related accept", *([dns] if policy.allow else [])]
        inner = generation_script(
            policy,
            sb.inner,
            never,
            table=INNER_TABLE,
            prefix="",
            base_chain="output",
            head=head,
            deny=INNER_DENY,
        )
        outer = generation_script(
            policy,
            sb.outer,
            never,
            table=INNER_TABLE,
            prefix=f"{sb.chain}_",
            base_chain=sb.chain,
            head=[f'ip saddr != {sb.ip} counter name "{sb.chain}_denied" drop'],
            deny=f'counter name "{sb.chain}_denied" drop',
        )
        await self._worker.nft(sb.pidfd, inner)
        self._advance(sb.inner, policy, never)
        await self._worker.nft(self._gw_fd, outer)
        self._advance(sb.outer, policy, never)
        sb.policy = policy

    @staticmethod
    def _advance(state: RuleState, policy: NetworkPolicy, never: Sequence[str]) -> None:
        if state.gen:
            state.old_gens.append(state.gen)
        state.gen += 1
        state.sets |= state.wanted(policy, never)

    async def _collect(self, sb: SandboxNet) -> None:
        """Delete what the last switch shadowed, off the caller's path (another thread)."""
        async with sb.lock:
            if sb.id not in self.sandboxes:
                return
            never = self.never()
            for state, fd, prefix, base in (
                (sb.inner, sb.pidfd, "", "output"),
                (sb.outer, self._gw_fd, f"{sb.chain}_", sb.chain),
            ):
                if not state.old_gens:
                    continue
                wanted = state.wanted(sb.policy, never)
                try:
                    await self._gc_worker.nft(
                        fd, gc_script(state, wanted, table=INNER_TABLE, prefix=prefix, base_chain=base)
                    )
                except (NftError, OSError) as e:  # a sandbox that just died
                    log.debug("netpolicy gc for %s: %s", sb.id, e)
                    continue
                state.old_gens.clear()
                state.sets &= wanted

    async def _link(self, sb: SandboxNet) -> None:
        await self._worker.call(sb.pidfd, _sandbox_sysctls)
        await self._ip(
            ["ip", "-n", self.gw_netns, "-batch", "-"],
            f"link add {sb.ifname} type veth peer name {SANDBOX_IF} netns {sb.pid}\n"
            f"addr add {self.gw_ip}/32 dev {sb.ifname}\n"
            f"link set {sb.ifname} up\n"
            f"route add {sb.ip}/32 dev {sb.ifname} src {self.gw_ip}\n",
        )
        await self._ip(
            ["nsenter", f"--net=/proc/{sb.pid}/ns/net", "ip", "-batch", "-"],
            f"addr add {sb.ip}/32 dev {SANDBOX_IF}\n"
            f"link set {SANDBOX_IF} up\n"
            f"route add {self.gw_ip}/32 dev {SANDBOX_IF} scope link\n"
            f"route add default via {self.gw_ip} dev {SANDBOX_IF}\n",
        )
        if not sb.alive():  # the pid was read before we held the pidfd: be sure it is the sandbox
            raise ProcessLookupError(sb.pid)

    async def _forget(self, sb: SandboxNet) -> None:
        self.sandboxes.pop(sb.id, None)
        self._by_ip.pop(sb.ip, None)
        if self._gw_fd >= 0:
            with contextlib.suppress(NftError):
                await self._gc_worker.nft(
                    self._gw_fd, gw_remove_script(chain=sb.chain, ifname=sb.ifname, state=sb.outer)
                )
            for cmd in gw_forget_limits_script(ifname=sb.ifname):
                with contextlib.suppress(NftError):  # no element: the link never used that share
                    await self._gc_worker.nft(self._gw_fd, cmd)
            if sb.alive():  # a dead sandbox's netns takes both ends of the link with it
                await run_tool(["ip", "-n", self.gw_netns, "link", "del", sb.ifname])
        os.close(sb.pidfd)
        self._free.append(sb.index)

    async def remove(self, sandbox_id: str) -> None:
        """Forget a sandbox's policy: its gateway chain, sets, counter and link. The
        sandbox's own table goes with its namespace (or stays, denying, if it still runs)."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            return
        if sb.gc is not None and not sb.gc.done():
            sb.gc.cancel()
        async with sb.lock:
            if self.sandboxes.get(sandbox_id) is sb:
                await self._forget(sb)

    def policy(self, sandbox_id: str) -> NetworkPolicy | None:
        sb = self.sandboxes.get(sandbox_id)
        return sb.policy if sb else None

    async def counters(self, sandbox_id: str) -> dict[str, int]:
        """Denied packets and bytes (inner + outer chain), allowed and denied DNS queries."""
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            return {}
        inner, limited = sb.last_inner, sb.last_limited
        if sb.alive():
            with contextlib.suppress(NftError, OSError):
                out = await self._worker.nft(sb.pidfd, "list counter inet dsec denied\n", json_output=True)
                inner = _counter(out)
                sb.last_inner = inner
            with contextlib.suppress(NftError, OSError):
                out = await self._worker.nft(sb.pidfd, "list counter inet dsec limited\n", json_output=True)
                limited = _counter(out)
                sb.last_limited = limited
        outer = (0, 0)
        with contextlib.suppress(NftError, OSError):
            cmd = f"list counter inet dsec {sb.chain}_denied\n"
            outer = _counter(await self._worker.nft(self._gw_fd, cmd, json_output=True))
        return {
            "denied_packets": inner[0] + outer[0],
            "denied_bytes": inner[1] + outer[1],
            "denied_packets_gateway": outer[0],
            "connections_limited": limited[0],
            **sb.dns,
        }

    async def learn(self, sb: SandboxNet, rules: Sequence[NetRule], addrs: Sequence[tuple[str, int]]) -> None:
        """Allow addresses an allowed name resolved to, for the TTL (see DNS_* constants)."""
        if not addrs:
            return
        timed = [(a, min(max(ttl, DNS_MIN_TTL), DNS_MAX_TTL) + DNS_GRACE_S) for a, ttl in addrs]
        suffixes = sorted({_set_suffix(r.to) for r in rules} & domain_sets(sb.policy))
        if not suffixes:
            return
        await self._worker.nft(sb.pidfd, add_addresses_script("inet dsec", suffixes, timed))
        await self._worker.nft(
            self._gw_fd, add_addresses_script("inet dsec", [f"{sb.chain}_{s}" for s in suffixes], timed)
        )

    def by_ip(self, ip: str) -> SandboxNet | None:
        return self._by_ip.get(ip)

    async def close(self, *, keep: bool = False) -> None:
        """Remove the gateway and everything in it (``keep``: leave it for a restarted
        edge, which rebuilds it on its first apply)."""
        for sb in list(self.sandboxes.values()):
            if keep:
                os.close(sb.pidfd)
            else:
                with contextlib.suppress(Exception):
                    await self.remove(sb.id)
        self.sandboxes.clear()
        self._by_ip.clear()
        if self._dns is not None:
            self._dns.close()
            self._dns = None
        if self._ready and not keep:
            await self._destroy_gateway()
        if self._gw_fd >= 0:
            os.close(self._gw_fd)
            self._gw_fd = -1
        self._ready = False
        self._worker.close()
        self._gc_worker.close()


def _sandbox_sysctls() -> None:
    """In the sandbox's namespace, before its link exists: no IPv6 on new links (no
    router solicitations to count as denied; sandboxes are IPv4-only), and ICMP echo
    sockets for its processes, which have no CAP_NET_RAW (the rules decide where ICMP may
    go; written as host root, so the gid range is in host ids: every group)."""
    _write_sysctl("net.ipv6.conf.default.disable_ipv6", "1")
    _write_sysctl("net.ipv4.ping_group_range", "0 2147483647")


def _gateway_sysctls() -> None:
    _write_sysctl("net.ipv6.conf.default.disable_ipv6", "1")
    _write_sysctl("net.ipv4.ip_forward", "1")
    # The gateway's rejects (limits) go to its own sandboxes only: none may be rate-limited
    # away, or a refused connect() would hang in SYN retries instead of failing at once.
    _write_sysctl("net.ipv4.icmp_ratelimit", "0")


def _counter(out: str) -> tuple[int, int]:
    for item in json.loads(out).get("nftables", []):
        c = item.get("counter")
        if c:
            return int(c.get("packets", 0)), int(c.get("bytes", 0))
    return 0, 0


# --------------------------------------------------------------------------- the DNS forwarder


class DnsForwarder:
    """Answers a sandbox's queries for its allowed names only, and allows what they
    resolve to before it replies (see the module docstring).

    Shared by every sandbox of the edge, so each gets a bounded share (NetLimits): a query
    budget (a token bucket; UDP beyond it is dropped, also in the gateway's kernel, and a
    TCP connection beyond it waits), a few TCP connections with a short idle timeout and
    a write deadline, a few upstream lookups at a time. Denied names are answered at once
    from the datagram callback (no task, no upstream); nothing waits on one client."""

    def __init__(
        self, host: NetHost, upstreams: Sequence[tuple[str, int]], limits: NetLimits | None = None
    ) -> None:
        self.host = host
        self.upstreams = list(upstreams)
        self.limits = limits or NetLimits()
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.tcp_open = 0

    async def start(self, netns_path: str, ip: str) -> None:
        loop = asyncio.get_running_loop()
        us = socket_in_netns(netns_path, socket.AF_INET, socket.SOCK_DGRAM)
        ts = socket_in_netns(netns_path, socket.AF_INET, socket.SOCK_STREAM)
        try:
            us.bind((ip, DNS_PORT))
            ts.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ts.bind((ip, DNS_PORT))
            us.setblocking(False)
            ts.setblocking(False)
        except BaseException:
            us.close()
            ts.close()
            raise
        fwd = self

        class _Udp(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
                fwd._datagram(data, addr)

        transport, _ = await loop.create_datagram_endpoint(_Udp, sock=us)
        self._udp = transport  # type: ignore[assignment]
        self._tcp = await asyncio.start_server(self._tcp_client, sock=ts, backlog=256)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        sb = self.host.by_ip(addr[0])
        if sb is None or self._udp is None:
            return  # only linked sandboxes get here (the gateway drops forged sources)
        if not sb.dns_bucket.take():
            sb.dns["dns_limited"] += 1
            return
        local = self._local_answer(data, sb)
        if local is not None:
            if local:
                self._udp.sendto(local, addr)
            return
        if sb.dns_inflight >= self.limits.dns_inflight:
            sb.dns["dns_limited"] += 1
            return
        self._spawn(self._udp_query(data, addr, sb))

    async def _udp_query(self, data: bytes, addr: tuple[str, int], sb: SandboxNet) -> None:
        reply = await self._forward(data, sb, tcp=False)
        if reply is not None and self._udp is not None:
            self._udp.sendto(reply, addr)

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sb = self.host.by_ip(peer[0]) if peer else None
        lim = self.limits
        if sb is None or sb.dns_tcp >= lim.dns_tcp or self.tcp_open >= lim.dns_tcp_total:
            if sb is not None:
                sb.dns["dns_limited"] += 1
            writer.transport.abort()
            return
        sb.dns_tcp += 1
        self.tcp_open += 1
        try:
            for _ in range(lim.dns_tcp_queries):
                n = struct.unpack("!H", await asyncio.wait_for(reader.readexactly(2), lim.dns_tcp_idle))[0]
                data = await asyncio.wait_for(reader.readexactly(n), lim.dns_tcp_idle)
                while not sb.dns_bucket.take():  # over budget: this connection waits, nothing else
                    sb.dns["dns_limited"] += 1
                    await asyncio.sleep(sb.dns_bucket.wait_s())
                reply = self._local_answer(data, sb)
                if reply is None:
                    reply = await self._forward(data, sb, tcp=True)
                if not reply:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await asyncio.wait_for(writer.drain(), lim.dns_tcp_idle)  # a client that does not read
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError, struct.error):
            pass
        finally:
            sb.dns_tcp -= 1
            self.tcp_open -= 1
            writer.transport.abort()  # never linger on unsent data: the descriptor goes now

    def _local_answer(self, query: bytes, sb: SandboxNet) -> bytes | None:
        """The reply made without asking upstream (b"": drop the query), or None."""
        try:
            _, name, qtype, qend = parse_query(query)
        except DnsError:
            return b""
        if not sb.policy.domain_rules(name):
            sb.dns["dns_denied"] += 1
            return reply_without_answer(query, qend, 3)
        if qtype == 28:  # AAAA: no IPv6 in sandboxes; no data makes clients use A at once
            sb.dns["dns_allowed"] += 1
            return reply_without_answer(query, qend, 0)
        return None

    async def _forward(self, query: bytes, sb: SandboxNet, *, tcp: bool) -> bytes | None:
        """An allowed name: ask upstream, allow what it resolved to (never a platform
        address), then reply."""
        try:
            _, name, _, qend = parse_query(query)
        except DnsError:
            return None
        rules = sb.policy.domain_rules(name)
        if not rules:
            return reply_without_answer(query, qend, 3)
        sb.dns["dns_allowed"] += 1
        sb.dns_inflight += 1
        try:
            raw = await self._upstream(query, tcp=tcp)
            reply = bytearray(raw)
            addrs = a_records(reply)
            allowed = [(a, t) for a, t in addrs if not self.host.is_platform(a)]
            if len(allowed) < len(addrs):
                sb.dns["dns_platform"] += len(addrs) - len(allowed)
                log.warning("dns: %s for %s resolved to a platform address: not allowed", name, sb.id)
            if sb.id in self.host.sandboxes:
                await self.host.learn(sb, rules, allowed)
        except (OSError, TimeoutError, DnsError, NftError) as e:
            log.warning("dns: %s for %s (%s): %s", name, sb.id, sb.ip, e)
            return reply_without_answer(query, qend, 2)
        finally:
            sb.dns_inflight -= 1
        return bytes(reply)

    async def answer(self, query: bytes, src: str, *, tcp: bool) -> bytes | None:
        """The reply to one query from `src` (None: drop it); no budget is charged."""
        sb = self.host.by_ip(src)
        if sb is None:
            try:
                qend = parse_query(query)[3]
            except DnsError:
                return None
            return reply_without_answer(query, qend, 5)
        local = self._local_answer(query, sb)
        if local is not None:
            return local or None
        return await self._forward(query, sb, tcp=tcp)

    async def _upstream(self, query: bytes, *, tcp: bool) -> bytes:
        ident = random.randrange(1 << 16)
        q = struct.pack("!H", ident) + query[2:]
        last: BaseException = OSError("no upstream DNS server")
        for host, port in self.upstreams:
            try:
                raw = await asyncio.wait_for(
                    self._tcp_exchange(host, port, q) if tcp else self._udp_exchange(host, port, q),
                    DNS_UPSTREAM_TIMEOUT,
                )
            except (OSError, TimeoutError) as e:
                last = e
                continue
            return query[:2] + raw[2:]
        raise last

    @staticmethod
    async def _udp_exchange(host: str, port: int, q: bytes) -> bytes:
        """One query on a connected socket with a random port; only a reply with our id
        and our question is taken."""
        loop = asyncio.get_running_loop()
        _, _, _, qend = parse_query(q)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            await loop.sock_connect(s, (host, port))
            await loop.sock_sendall(s, q)
            while True:
                raw = await loop.sock_recv(s, 65535)
                if raw[:2] == q[:2] and raw[12:qend].lower() == q[12:qend].lower():
                    return raw

    @staticmethod
    async def _tcp_exchange(host: str, port: int, q: bytes) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(struct.pack("!H", len(q)) + q)
            await writer.drain()
            n = struct.unpack("!H", await reader.readexactly(2))[0]
            return await reader.readexactly(n)
        finally:
            writer.close()

    def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None
        for t in list(self._tasks):
            t.cancel()
