"""What every part of the edge shares: the host's pieces and the edge's in-memory state.

The facade (edge.py) makes one `EdgeCore` and hands it to each part; each part also gets,
by name, the few operations of other parts it calls. A part reads the shared pieces
through `EdgePart`'s properties, so a piece replaced before start (`Edge.net = ...`) or
opened at start (`store`) is seen by every part at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsec.backends.base import Backend
from dsec.config import EdgeSettings
from dsec.edge.sandbox import Sandbox
from dsec.edge.store import EdgeStore
from dsec.isolation.cgroups import CgroupHost
from dsec.isolation.netpolicy import NetHost
from dsec.layers import LayerStore
from dsec.trajlog import TrajectoryLog


@dataclass
class EdgeCore:
    settings: EdgeSettings
    layers: LayerStore
    cgroups: CgroupHost
    trajlog: TrajectoryLog
    net: NetHost  # nothing is made on the host before the first network policy
    store: EdgeStore | None = None  # the sandbox records: open while the edge runs
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)  # the live ones, by id
    backends: dict[str, Backend] = field(default_factory=dict)  # by name, filled at start
    absent_backends: dict[str, str] = field(default_factory=dict)  # asked for but unavailable: why
    dirty_active: dict[str, float] = field(default_factory=dict)  # last activity not yet stored


class EdgePart:
    """A part of the edge: reads the shared pieces of its `EdgeCore`."""

    def __init__(self, core: EdgeCore) -> None:
        self.core = core

    @property
    def settings(self) -> EdgeSettings:
        return self.core.settings

    @property
    def name(self) -> str:
        return self.core.settings.name

    @property
    def layers(self) -> LayerStore:
        return self.core.layers

    @property
    def cgroups(self) -> CgroupHost:
        return self.core.cgroups

    @property
    def trajlog(self) -> TrajectoryLog:
        return self.core.trajlog

    @property
    def net(self) -> NetHost:
        return self.core.net

    @property
    def store(self) -> EdgeStore | None:
        return self.core.store

    @property
    def sandboxes(self) -> dict[str, Sandbox]:
        return self.core.sandboxes

    @property
    def backends(self) -> dict[str, Backend]:
        return self.core.backends

    @property
    def _dirty_active(self) -> dict[str, float]:
        return self.core.dirty_active
