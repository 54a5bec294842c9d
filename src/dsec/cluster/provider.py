"""The node provider interface: where more edges come from when the cluster is short, and
where idle ones go back to. The apiserver's capacity manager (dsec.apiserver.capacity) is its
only caller; implementations: `local` (edges of a `dsec cluster up` cluster, made and removed
for real: dsec.cluster.providers) and `kubernetes` (placeholder pods a cluster autoscaler
turns into nodes: dsec.cluster.kubernetes). This module imports nothing else of dsec."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeInfo:
    """One node the provider holds: `name` is the edge's name once it runs (a local edge's
    name; a Kubernetes node's name, which its edge takes), or a placeholder's while it waits."""

    name: str
    state: str  # "ready" (an edge runs there) or "pending" (asked for, not there yet)
    detail: str = ""


class NodeProvider(ABC):
    """Adds and removes edges. Calls may block for seconds (a process to start, an API to
    call): the caller runs them off its event loop's critical path."""

    kind: str = "none"

    @abstractmethod
    async def add(self, n: int) -> list[str]:
        """Ask for `n` more edges; the names of what was asked for (edges or placeholders).
        The edges register with the apiservers themselves when they are up."""

    @abstractmethod
    async def remove(self, edge: str) -> None:
        """Give the node of edge `edge` back (its edge stopped first where the provider can).
        Unknown names are a no-op: a removal may be retried."""

    @abstractmethod
    async def list(self) -> list[NodeInfo]:
        """The nodes this provider holds."""

    async def aclose(self) -> None:  # noqa: B027 - optional
        """Release what the provider holds open (connections); its nodes stay."""
