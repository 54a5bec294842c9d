"""Compiling a policy to nftables scripts: the sandbox's own table, the gateway's per-sandbox
chains, the host's table."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dsec.isolation.netpolicy.limits import DNS_PORT, GW_UPLINK_IF, NetLimits
from dsec.models.network import NetRule, NetworkPolicy

log = logging.getLogger("dsec.netpolicy")

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


def inner_base_script(*, gw_ip: str, limits: NetLimits, hook: str = "output") -> str:
    """Created once per sandbox: only additions, so it is as fast as a rule load. The
    ``limits`` chain is never flushed (its counts survive policy updates). `hook`: where the
    sandbox's own packets pass in its namespace: output (its processes are there), or
    forward (a VM's guest, behind a tap)."""
    t = INNER_TABLE
    lim = 'counter name "limited" reject with icmpx admin-prohibited'
    return (
        "\n".join(
            [
                f"add table {t}",
                f"add counter {t} denied",
                f"add counter {t} limited",
                f"add chain {t} limits {{ type filter hook {hook} priority filter - 1; }}",
                f'add rule {t} limits oif "lo" accept',
                f"add rule {t} limits ip daddr {gw_ip} meta l4proto {{ tcp, udp }} "
                f"th dport {DNS_PORT} accept",
                f"add rule {t} limits ct state new ct count over {limits.ct_open} {lim}",
                f"add rule {t} limits ct state new limit rate over {limits.ct_rate}/second "
                f"burst {limits.ct_burst} packets {lim}",
                f"add chain {t} output {{ type filter hook {hook} priority filter; policy drop; }}",
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
