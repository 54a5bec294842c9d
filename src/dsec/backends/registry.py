"""Backends by name.

A backend is a module with a `Backend` subclass and one line here (or a call to `register`
from a plugin or a test); the edge starts the ones its settings name and never branches on
a backend's kind. Modules are imported only when their backend is started, so an edge that
runs containers loads no gVisor or QEMU code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from dsec.backends.base import Backend, BackendHost
from dsec.errors import InvalidRequest

Factory = Callable[[BackendHost], Backend]

# name -> "module:class" (imported on first use) or a factory registered at run time
_KNOWN: dict[str, str | Factory] = {
    "container": "dsec.backends.container:ContainerBackend",
    "gvisor": "dsec.backends.gvisor:GvisorBackend",
    "microvm": "dsec.backends.microvm:MicrovmBackend",
}

DEFAULT = "container"


def register(name: str, factory: Factory) -> None:
    """Make `name` startable (a plugin's backend, or a test's variant of one)."""
    _KNOWN[name] = factory


def unregister(name: str) -> None:
    if name != DEFAULT:
        _KNOWN.pop(name, None)


def names() -> list[str]:
    return sorted(_KNOWN)


def start(name: str, host: BackendHost) -> Backend:
    """Construct backend `name` on this host."""
    entry = _KNOWN.get(name)
    if entry is None:
        raise InvalidRequest(f"unknown backend {name!r}; known: {', '.join(names())}")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        assert callable(entry)
    return entry(host)
