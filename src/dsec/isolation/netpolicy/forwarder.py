"""The per-gateway DNS forwarder: answers only names a sandbox's rules allow and teaches the
rules their addresses."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
from collections.abc import Sequence
from typing import Any, Protocol

from dsec.aio import wait_for
from dsec.isolation.netpolicy.dnsmsg import DnsError, a_records, parse_query, reply_without_answer
from dsec.isolation.netpolicy.kernel import NftError, socket_in_netns
from dsec.isolation.netpolicy.limits import DNS_PORT, DNS_UPSTREAM_TIMEOUT, NetLimits
from dsec.isolation.netpolicy.sandboxnet import SandboxNet
from dsec.models.network import NetRule

log = logging.getLogger("dsec.netpolicy")

# --------------------------------------------------------------------------- the DNS forwarder


class ForwarderHost(Protocol):
    """What the forwarder asks of its gateway (NetHost)."""

    sandboxes: dict[str, SandboxNet]

    def by_ip(self, ip: str) -> SandboxNet | None: ...

    def is_platform(self, address: str) -> bool: ...

    async def learn(
        self, sb: SandboxNet, rules: Sequence[NetRule], addrs: Sequence[tuple[str, int]]
    ) -> None: ...


class DnsForwarder:
    """Answers a sandbox's queries for its allowed names only, and allows what they
    resolve to before it replies (see the module docstring).

    Shared by every sandbox of the edge, so each gets a bounded share (NetLimits): a query
    budget (a token bucket; UDP beyond it is dropped, also in the gateway's kernel, and a
    TCP connection beyond it waits), a few TCP connections with a short idle timeout and
    a write deadline, a few upstream lookups at a time. Denied names are answered at once
    from the datagram callback (no task, no upstream); nothing waits on one client."""

    def __init__(
        self, host: ForwarderHost, upstreams: Sequence[tuple[str, int]], limits: NetLimits | None = None
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
                n = struct.unpack("!H", await wait_for(reader.readexactly(2), lim.dns_tcp_idle))[0]
                data = await wait_for(reader.readexactly(n), lim.dns_tcp_idle)
                while not sb.dns_bucket.take():  # over budget: this connection waits, nothing else
                    sb.dns["dns_limited"] += 1
                    await asyncio.sleep(sb.dns_bucket.wait_s())
                reply = self._local_answer(data, sb)
                if reply is None:
                    reply = await self._forward(data, sb, tcp=True)
                if not reply:
                    break
                writer.write(struct.pack("!H", len(reply)) + reply)
                await wait_for(writer.drain(), lim.dns_tcp_idle)  # a client that does not read
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
                raw = await wait_for(
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
