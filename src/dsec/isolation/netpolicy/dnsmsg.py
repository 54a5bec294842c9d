"""DNS messages, parsed and built just enough for the forwarder (queries, NXDOMAIN replies, A records)."""

from __future__ import annotations

import logging
import socket
import struct

from dsec.isolation.netpolicy.limits import DNS_MAX_TTL

log = logging.getLogger("dsec.netpolicy")

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
