"""NetHost: the per-edge gateway namespace, the sandboxes' links and rules, the host's table."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence

from dsec import errors
from dsec.isolation.netpolicy.forwarder import DnsForwarder
from dsec.isolation.netpolicy.hostfacts import (
    _collapse,
    _host_routes,
    _read_sysctl,
    _resolv_conf_upstreams,
    _resolve_names,
    _write_sysctl,
    host_addresses,
    parse_platform,
)
from dsec.isolation.netpolicy.kernel import NetnsWorker, NftError, run_tool
from dsec.isolation.netpolicy.limits import (
    _BLOCKED_WHY,
    ALWAYS_BLOCKED,
    DEFAULT_SUPERNET,
    DNS_GRACE_S,
    DNS_MAX_TTL,
    DNS_MIN_TTL,
    DNS_PORT,
    GW_UPLINK_IF,
    NEVER_CACHE_S,
    PLATFORM_ENV,
    PLATFORM_RESOLVE_S,
    SANDBOX_IF,
    NetLimits,
)
from dsec.isolation.netpolicy.rules import (
    INNER_DENY,
    INNER_TABLE,
    RuleState,
    _set_suffix,
    add_addresses_script,
    domain_sets,
    gc_script,
    generation_script,
    gw_base_script,
    gw_forget_limits_script,
    gw_remove_script,
    gw_sandbox_base_script,
    host_script,
    inner_base_script,
)
from dsec.isolation.netpolicy.sandboxnet import SandboxNet, TokenBucket
from dsec.models.network import NetRule, NetworkPolicy

log = logging.getLogger("dsec.netpolicy")


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
        self, sandbox_id: str, pid: int, policy: NetworkPolicy, *, check: bool = True, hook: str = "output"
    ) -> dict[str, float]:
        """Give a running sandbox `policy` (the first call links it to the gateway; later
        calls replace its rules atomically). Returns timings in ms. `check`: refuse a rule
        that names the platform (see check(); False when re-applying a stored policy: the
        rules drop those addresses anyway). `hook`: where its packets pass in its namespace
        (output; forward for a VM's guest), taken at the first call."""
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
                sb = SandboxNet(sandbox_id, pid, pidfd, index, self._sandbox_ip(index), policy, hook)
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
        base = inner_base_script(gw_ip=self.gw_ip, limits=self.limits, hook=sb.hook)
        await self._worker.nft(sb.pidfd, base)
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
