"""What the edge holds for one sandbox with a policy, and the token bucket of its DNS share."""

from __future__ import annotations

import asyncio
import logging
import select
import time
from dataclasses import dataclass, field

from dsec.isolation.netpolicy.rules import RuleState
from dsec.models.network import NetworkPolicy

log = logging.getLogger("dsec.netpolicy")

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
    hook: str = "output"  # the sandbox's packets: output, or forward (a VM's guest behind a tap)
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
