"""Network policy on the wire: a sandbox's egress allowlist (enforced by
dsec.isolation.netpolicy on the edge)."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_RULES = 256

Protocol = Literal["tcp", "udp", "icmp"]
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
DOMAIN_RE = re.compile(rf"^(\*\.)?({_LABEL}\.)*{_LABEL}$")
_PORTS = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?$")


class NetRule(BaseModel):
    """One allowlist entry: a destination, ports, protocols.

    ``to``: a domain (``pypi.org``; ``*.pythonhosted.org`` = every subdomain, not the
    apex), an IPv4 address or an IPv4 CIDR. ``ports``: numbers or ``"lo-hi"`` ranges;
    empty = every port. ``protocols``: tcp (default), udp, icmp (ports do not apply)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    to: Annotated[str, Field(min_length=1, max_length=253)]
    ports: Annotated[list[int | str], Field(max_length=64)] = Field(default_factory=list)
    protocols: Annotated[list[Protocol], Field(min_length=1, max_length=3)] = Field(
        default_factory=lambda: list[Protocol](["tcp"])
    )

    @field_validator("to")
    @classmethod
    def _dest(cls, v: str) -> str:
        v = v.strip().lower().rstrip(".")
        try:
            net = ipaddress.ip_network(v, strict=False)
        except ValueError:
            if not DOMAIN_RE.match(v):
                raise ValueError(f"{v!r} is not a domain, an IPv4 address or an IPv4 CIDR") from None
            if v.replace(".", "").isdigit():
                raise ValueError(f"{v!r} is not a valid IPv4 address") from None
            return v
        if net.version != 4:
            raise ValueError("sandboxes have IPv4 connectivity only; give an IPv4 address or CIDR")
        return str(net) if net.prefixlen < 32 else str(net.network_address)

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int | str]) -> list[int | str]:
        out: list[int | str] = []
        for p in v:
            m = _PORTS.match(str(p).strip())
            lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
            if not m or not (1 <= lo <= hi <= 65535):
                raise ValueError(f"port {p!r} must be 1-65535 or a range 'lo-hi'")
            out.append(lo if lo == hi else f"{lo}-{hi}")
        return out

    @property
    def is_domain(self) -> bool:
        try:
            ipaddress.ip_network(self.to)
        except ValueError:
            return True
        return False

    @property
    def is_exact_ip(self) -> bool:
        return not self.is_domain and "/" not in self.to

    def matches(self, name: str) -> bool:
        """Does a (lowercase, dot-free-ended) DNS name fall under this domain rule?"""
        if not self.is_domain:
            return False
        if self.to.startswith("*."):
            return name.endswith(self.to[1:]) and len(name) > len(self.to) - 1
        return name == self.to


class NetworkPolicy(BaseModel):
    """A sandbox's egress allowlist. ``allow=[]`` (attached, nothing allowed) and no
    policy at all (loopback only) both deny everything; only a policy makes a link."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: Annotated[list[NetRule], Field(max_length=MAX_RULES)] = Field(default_factory=list)

    def domain_rules(self, name: str) -> list[NetRule]:
        return [r for r in self.allow if r.matches(name)]
