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

from dsec.isolation.netpolicy.dnsmsg import parse_query, reply_without_answer
from dsec.isolation.netpolicy.gateway import NetHost
from dsec.isolation.netpolicy.hostfacts import host_addresses
from dsec.isolation.netpolicy.kernel import socket_in_netns
from dsec.isolation.netpolicy.limits import NetLimits

# The package's face: the edge uses NetHost; the tests reach the rest. The parts: rules.py
# (compiled nft scripts), kernel.py (libnftables, namespace workers), forwarder.py and
# dnsmsg.py (DNS), sandboxnet.py (one sandbox's link), limits.py, hostfacts.py.
__all__ = ["NetHost", "NetLimits", "host_addresses", "parse_query", "reply_without_answer", "socket_in_netns"]
