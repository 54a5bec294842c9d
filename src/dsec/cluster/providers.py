"""Node providers (dsec.cluster.provider.NodeProvider) and the choice among them.

`local`: edges of the `dsec cluster up` cluster in a directory, made and removed for real (a
namespace and a process each: dsec.cluster.local.add_edge / remove_edge). `kubernetes`:
placeholder pods a cluster autoscaler reacts to (dsec.cluster.kubernetes). Only the process
that assembles an apiserver (dsec.service) chooses one; the apiserver sees the interface."""

from __future__ import annotations

import asyncio
from pathlib import Path

from dsec.cluster import local
from dsec.cluster.kubernetes import KubernetesProvider, KubernetesSettings
from dsec.cluster.provider import NodeInfo, NodeProvider
from dsec.errors import InvalidRequest

PROVIDERS = ("none", "local", "kubernetes")


class LocalProvider(NodeProvider):
    """Edges of the local cluster in `cluster_dir`. An edge it adds registers with every
    apiserver of the cluster by itself (a few seconds: its layer store is a hard-link copy)."""

    kind = "local"

    def __init__(self, cluster_dir: Path) -> None:
        self.dir = cluster_dir

    async def add(self, n: int) -> list[str]:
        added = await asyncio.to_thread(local.add_edge, self.dir, n)
        return [m.name for m in added]

    async def remove(self, edge: str) -> None:
        await asyncio.to_thread(local.remove_edge, self.dir, edge)

    async def list(self) -> list[NodeInfo]:
        state = await asyncio.to_thread(local.ClusterState.load, self.dir)
        return [NodeInfo(e.name, "ready", e.address) for e in state.edges]


def make_provider(kind: str, cluster_dir: Path | None = None) -> NodeProvider | None:
    """The provider an apiserver's settings name (None for "none")."""
    if kind == "none":
        return None
    if kind == "local":
        if cluster_dir is None:
            raise InvalidRequest(
                "the local node provider needs the cluster's directory: DSEC_APISERVER_CLUSTER_DIR "
                "(set by `dsec cluster up` for its apiservers)"
            )
        return LocalProvider(cluster_dir)
    if kind == "kubernetes":
        return KubernetesProvider(KubernetesSettings())
    raise InvalidRequest(f"unknown node provider {kind!r}: one of {', '.join(PROVIDERS)}")
