"""What every part of the edge shares: the host's pieces and the edge's in-memory state.

The facade (edge.py) makes one `EdgeCore` and hands it to each part; each part also gets,
by name, the few operations of other parts it calls. A part reads the shared pieces
through `EdgePart`'s properties, so a piece replaced before start (`Edge.net = ...`) or
opened at start (`store`) is seen by every part at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from dsec.backends.base import Backend
from dsec.config import EdgeSettings
from dsec.edge.sandbox import Sandbox
from dsec.edge.store import EdgeStore
from dsec.isolation.cgroups import CgroupHost
from dsec.isolation.netpolicy import NetHost
from dsec.layers import LayerStore
from dsec.trajlog import TrajectoryLog

T = TypeVar("T")


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


class _FromCore(Generic[T]):
    """A read-only attribute of a part: the field of the same name (without a leading
    underscore) of the part's core, read at each access."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name.lstrip("_")

    def __get__(self, part: EdgePart, owner: type | None = None) -> T:
        return cast(T, getattr(part.core, self.field))

    def __set__(self, part: EdgePart, value: T) -> None:
        raise AttributeError(f"{self.field} is the core's: set it there")


class EdgePart:
    """A part of the edge: reads the shared pieces of its `EdgeCore`."""

    settings = _FromCore[EdgeSettings]()
    layers = _FromCore[LayerStore]()
    cgroups = _FromCore[CgroupHost]()
    trajlog = _FromCore[TrajectoryLog]()
    net = _FromCore[NetHost]()
    store = _FromCore[EdgeStore | None]()
    sandboxes = _FromCore[dict[str, Sandbox]]()
    backends = _FromCore[dict[str, Backend]]()
    _dirty_active = _FromCore[dict[str, float]]()

    def __init__(self, core: EdgeCore) -> None:
        self.core = core

    @property
    def name(self) -> str:
        return self.core.settings.name
