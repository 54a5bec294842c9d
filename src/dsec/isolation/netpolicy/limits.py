"""Constants of the network policy and the per-sandbox shares of per-edge pieces (NetLimits)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

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
