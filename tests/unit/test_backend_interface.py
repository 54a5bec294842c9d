"""The backend interface and registry (issue #12), without starting anything."""

from __future__ import annotations

import pytest

from dsec import errors
from dsec.backends import registry
from dsec.backends.base import Backend, BackendHost, Capability
from dsec.backends.container import ContainerBackend


def test_registry_and_interface():
    assert "container" in registry.names()
    with pytest.raises(errors.InvalidRequest, match="unknown backend 'nope'; known: container"):
        registry.start("nope", None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the interface is abstract: a backend must implement it all
        Backend()  # type: ignore[abstract]
    assert ContainerBackend.capabilities == frozenset(Capability)
    assert not ContainerBackend.__abstractmethods__
    assert BackendHost.__dataclass_fields__.keys() >= {"run_dir", "shim", "cgroups", "net"}
